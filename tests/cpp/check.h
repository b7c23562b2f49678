// A minimal test harness for the C++ unit tests (no downloads, no
// dependencies). TEST(name) { ... } defines and registers a test; inside,
// CHECK(condition), CHECK_EQ(actual, expected),
// CHECK_EQ_FOR(actual, expected, input) (naming the input in the message, for
// loops over tables) and CHECK_CONTAINS(text, part) record a failure (with
// file, line and values) and let the test go on. check.cc's main runs every
// test, or those whose name contains its first argument, and exits 1 if any
// check failed.
#ifndef JAX_NVFP4_TESTS_CPP_CHECK_H_
#define JAX_NVFP4_TESTS_CPP_CHECK_H_

#include <sstream>
#include <string>
#include <vector>

namespace jax_nvfp4_test {

using TestFunction = void (*)();

// Adds a test to the list main runs; returns true (for a static's
// initializer).
bool Register(const char* name, TestFunction function);

// Records a failed check of the running test.
void Fail(const char* file, int line, const std::string& message);

template <typename T>
std::string Show(const T& value) {
  std::ostringstream out;
  out.precision(9);
  out << value;
  return out.str();
}
inline std::string Show(const std::string& value) { return '"' + value + '"'; }
inline std::string Show(const char* value) { return Show(std::string(value)); }
inline std::string Show(unsigned char value) { return Show(int{value}); }
inline std::string Show(bool value) { return value ? "true" : "false"; }
template <typename T>
std::string Show(const std::vector<T>& values) {
  std::string s = "{";
  for (size_t i = 0; i < values.size(); ++i) {
    s += (i ? ", " : "") + Show(values[i]);
  }
  return s + "}";
}

template <typename A, typename E>
void CheckEq(const A& actual, const E& expected, const char* actual_text,
             const char* expected_text, const char* file, int line,
             const std::string& input = "") {
  if (!(actual == expected)) {
    Fail(file, line,
         std::string(actual_text) + " == " + expected_text + ": got " +
             Show(actual) + ", expected " + Show(expected) +
             (input.empty() ? "" : " for " + input));
  }
}

inline void CheckContains(const std::string& text, const std::string& part,
                          const char* text_text, const char* file, int line) {
  if (text.find(part) == std::string::npos) {
    Fail(file, line,
         std::string(text_text) + " contains " + Show(part) + ": got " +
             Show(text));
  }
}

}  // namespace jax_nvfp4_test

#define TEST(name)                             \
  static void name();                          \
  static const bool name##_registered =        \
      ::jax_nvfp4_test::Register(#name, name); \
  static void name()

#define CHECK(condition)                                                   \
  do {                                                                     \
    if (!(condition)) {                                                    \
      ::jax_nvfp4_test::Fail(__FILE__, __LINE__, "CHECK(" #condition ")"); \
    }                                                                      \
  } while (false)

#define CHECK_EQ(actual, expected)                                    \
  ::jax_nvfp4_test::CheckEq((actual), (expected), #actual, #expected, \
                            __FILE__, __LINE__)

#define CHECK_EQ_FOR(actual, expected, input)                          \
  do {                                                                 \
    const auto& actual_value = (actual);                               \
    const auto& expected_value = (expected);                           \
    if (!(actual_value == expected_value)) {                           \
      ::jax_nvfp4_test::CheckEq(actual_value, expected_value, #actual, \
                                #expected, __FILE__, __LINE__,         \
                                ::jax_nvfp4_test::Show(input));        \
    }                                                                  \
  } while (false)

#define CHECK_CONTAINS(text, part) \
  ::jax_nvfp4_test::CheckContains((text), (part), #text, __FILE__, __LINE__)

#endif  // JAX_NVFP4_TESTS_CPP_CHECK_H_
