// test_seam.h: the two places where tests reach into a run, in one file and compiled in only
// for tests: the astrai-train-seams binary (tests/train.cmake) is built with ASTRAI_TEST_SEAMS;
// in astrai-train these are nothing. Each reads its variable once, in the process that trains:
//
//   ASTRAI_TEST_OVERFLOW=RANK:STEP  rank RANK's backward of optimizer step STEP (1-based)
//                                   overflows (an infinite loss weight), as fp16 gradients can on
//                                   one rank (tests/test_loss_scale.py)
//   ASTRAI_TEST_CKPT_HOLD=FILE      a background checkpoint write waits until FILE exists, so a
//                                   test sees training go on while a write is in flight
//                                   (tests/test_ckpt_async.py)
#pragma once

#ifdef ASTRAI_TEST_SEAMS
// The loss weight of rank `rank`'s micro-batches of step `step` (1-based): `weight`, or
// infinity at the overflow the test asked for.
float test_seam_loss_weight(int rank, long step, float weight);
// Before a background checkpoint write: returns once the hold file exists (none: at once).
void test_seam_ckpt_hold(void);
#else
static inline float test_seam_loss_weight(int rank, long step, float weight) {
    (void)rank, (void)step;
    return weight;
}
static inline void test_seam_ckpt_hold(void) {}
#endif
