"""Offline stand-in for @rules_java//java:defs.bzl: Bazel's native Java rules.

Only @bazel_tools//tools/jdk loads it (its toolchains are registered in every
build); this project builds no Java.
"""

java_import = native.java_import
java_runtime = native.java_runtime
java_toolchain = native.java_toolchain
