// What every libtorch shim (src/ffi/*_shim.cpp) does at its C boundary: run the body, turn any
// C++ exception into a return code and a message, so that nothing unwinds into Rust (the Rust
// side: `call` in src/ffi/mod.rs).
#pragma once

#include <cstddef>
#include <cstring>
#include <exception>

namespace ladder {

// Copies `msg` into `err` (`errlen` bytes, NUL-terminated, truncated if needed).
inline void set_error(char *err, size_t errlen, const char *msg) {
  if (errlen == 0) return;
  std::strncpy(err, msg, errlen - 1);
  err[errlen - 1] = 0;
}

// Runs `body`; returns 0, or 1 with the exception's message in `err` (libtorch's errors are
// std::exceptions; anything else gets a fixed message).
template <typename F>
int guarded(char *err, size_t errlen, F &&body) {
  try {
    body();
    return 0;
  } catch (const std::exception &e) {
    set_error(err, errlen, e.what());
  } catch (...) {
    set_error(err, errlen, "a non-standard C++ exception");
  }
  return 1;
}

}  // namespace ladder
