// The harness of check.h: the list of tests and main.
#include "check.h"

#include <cstdio>
#include <string>
#include <vector>

namespace jax_nvfp4_test {
namespace {

struct Test {
  const char* name;
  TestFunction function;
};

std::vector<Test>& Tests() {
  static auto* tests = new std::vector<Test>();
  return *tests;
}

int failures_in_test = 0;
// A test that fails many checks (a loop over a table) reports the first few.
constexpr int kReportedPerTest = 10;

}  // namespace

bool Register(const char* name, TestFunction function) {
  Tests().push_back({name, function});
  return true;
}

void Fail(const char* file, int line, const std::string& message) {
  if (++failures_in_test <= kReportedPerTest) {
    std::fprintf(stderr, "%s:%d: failed: %s\n", file, line, message.c_str());
  }
}

}  // namespace jax_nvfp4_test

int main(int argc, char** argv) {
  using jax_nvfp4_test::Tests;
  const std::string filter = argc > 1 ? argv[1] : "";
  int run = 0, failed = 0;
  for (const auto& test : Tests()) {
    if (std::string(test.name).find(filter) == std::string::npos) continue;
    jax_nvfp4_test::failures_in_test = 0;
    test.function();
    ++run;
    const int failures = jax_nvfp4_test::failures_in_test;
    if (failures > 0) {
      ++failed;
      std::fprintf(stderr, "FAILED %s (%d failed checks)\n", test.name,
                   failures);
    } else {
      std::printf("ok %s\n", test.name);
    }
  }
  std::printf("%d tests, %d failed\n", run, failed);
  return failed > 0 || run == 0 ? 1 : 0;
}
