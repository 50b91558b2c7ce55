#pragma once

// What a fuzz target does when a property it checks is violated: print what
// broke and where, then trap, so libFuzzer records the input as a crash
// (crash-<sha1> in the working directory) and the sanitizer prints the stack.

#include <cstdio>

#define FUZZ_CHECK(condition, ...)                                                              \
  do {                                                                                          \
    if (!(condition)) {                                                                         \
      std::fprintf(stderr, "%s:%d: property violated: %s\n  ", __FILE__, __LINE__, #condition); \
      std::fprintf(stderr, __VA_ARGS__);                                                        \
      std::fprintf(stderr, "\n");                                                               \
      __builtin_trap();                                                                         \
    }                                                                                           \
  } while (0)
