// cuda_fp16.h: stand-in for the CUDA toolkit header of this name in the CPU emulation of the
// kernels (tests/cuda_emu/): everything the emulation provides is in emu.h.
#pragma once
#include "../emu.h"
