// Test input: must NOT compile (the compile check has to report the failure and nvcc's message).
__global__ void broken_kernel(float* out) {
    out[threadIdx.x] = undefined_symbol_for_test;
}
