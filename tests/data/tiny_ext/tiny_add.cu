// Tiny CUDA extension used only by tests/test_kernels_build.py to exercise the JIT loader
// (twell.kernels.build) before the real kernels in csrc/ exist. Not part of the library.
// c10/cuda headers instead of ATen/cuda/CUDAContext.h: the latter pulls in cuBLAS/cuSPARSE headers,
// which the CPU CI CUDA toolkit does not ship.
#include <torch/extension.h>
#include <c10/cuda/CUDAException.h>
#include <c10/cuda/CUDAStream.h>
#include <cuda_bf16.h>

namespace {

__global__ void add_scaled_kernel(const __nv_bfloat16* __restrict__ a, const __nv_bfloat16* __restrict__ b,
                                  float alpha, __nv_bfloat16* __restrict__ out, int64_t n) {
    int64_t i = blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x;
    if (i < n) {
        float v = __bfloat162float(a[i]) + alpha * __bfloat162float(b[i]);
        out[i] = __float2bfloat16(v);
    }
}

}  // namespace

// out = a + alpha * b for bf16 CUDA tensors of the same shape (fp32 arithmetic).
torch::Tensor add_scaled(torch::Tensor a, torch::Tensor b, double alpha) {
    TORCH_CHECK(a.is_cuda() && b.is_cuda(), "expected CUDA tensors");
    TORCH_CHECK(a.scalar_type() == at::kBFloat16 && b.scalar_type() == at::kBFloat16, "expected bf16 tensors");
    TORCH_CHECK(a.sizes() == b.sizes(), "expected tensors of the same shape");
    auto ac = a.contiguous();
    auto bc = b.contiguous();
    auto out = torch::empty_like(ac);
    int64_t n = ac.numel();
    if (n == 0) return out;
    int threads = 256;
    int64_t blocks = (n + threads - 1) / threads;
    add_scaled_kernel<<<static_cast<unsigned>(blocks), threads, 0, c10::cuda::getCurrentCUDAStream()>>>(
        reinterpret_cast<const __nv_bfloat16*>(ac.data_ptr()), reinterpret_cast<const __nv_bfloat16*>(bc.data_ptr()),
        static_cast<float>(alpha), reinterpret_cast<__nv_bfloat16*>(out.data_ptr()), n);
    C10_CUDA_KERNEL_LAUNCH_CHECK();
    return out;
}

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
    m.def("add_scaled", &add_scaled, "out = a + alpha * b (bf16, CUDA)");
}
