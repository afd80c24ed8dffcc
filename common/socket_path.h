// socket_path.h: where astraid listens and astraictl connects when no --socket is
// given, decided in one place for both (docs/astraid.md, docs/astraictl.md).
#pragma once
#include <stddef.h>

#include "common/error.h"

// The default control socket, written into buf:
//   $ASTRAID_SOCKET when set and not empty;
//   else, for root, /run/astraid/astraid.sock (the system service's);
//   else $XDG_RUNTIME_DIR/astraid/astraid.sock, or /tmp/astraid-UID/astraid.sock when
//   XDG_RUNTIME_DIR is unset or empty (UID: the effective uid).
// Fails, naming the path, when it does not fit in cap bytes.
int socket_default_path(char *buf, size_t cap, Err *err);
