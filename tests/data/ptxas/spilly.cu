// Test input for the ptxas report parser: compiled with -maxrregcount=16 this kernel keeps more
// live values than registers, so ptxas reports nonzero spill stores/loads. Also one clean kernel.
#define N 48

__global__ void spilly_kernel(const float* __restrict__ in, float* __restrict__ out, int n) {
    float acc[N];
#pragma unroll
    for (int k = 0; k < N; ++k) acc[k] = in[(threadIdx.x + k * 97) % n];
#pragma unroll
    for (int r = 0; r < 8; ++r) {
#pragma unroll
        for (int k = 0; k < N; ++k) acc[k] = acc[k] * acc[(k + r + 1) % N] + 1.0f;
    }
    float s = 0.f;
#pragma unroll
    for (int k = 0; k < N; ++k) s += acc[k] * (k + 1);
    out[blockIdx.x * blockDim.x + threadIdx.x] = s;
}

__global__ void clean_kernel(const float* __restrict__ in, float* __restrict__ out, int n) {
    __shared__ float buf[128];
    int i = blockIdx.x * blockDim.x + threadIdx.x;
    buf[threadIdx.x % 128] = i < n ? in[i] : 0.f;
    __syncthreads();
    if (i < n) out[i] = buf[(threadIdx.x + 1) % 128] * 2.f;
}
