// Test input: must fail to build; tests/test_kernels_build.py checks that the error message
// carries this compiler output and the build directory.
#error deliberate build failure for the loader test
