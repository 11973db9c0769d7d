// CUDA kernels for the CPU-Reduce path: fused scale + cast between a GPU
// tensor and the staging buffer that crosses PCIe.
//
// Built at first use with torch.utils.cpp_extension.load (needs nvcc and a
// CUDA build of torch); giantmodel/comm/cuda_reduce.py falls back to plain
// torch ops when it cannot be built.
//
//   scale_cast(src, dst, scale): dst[i] = (dst dtype)(src[i] * scale) in one
//   pass, e.g. fp32 gradients -> bf16 staging (half the PCIe bytes) with the
//   1/world of an average folded in.

#include <ATen/cuda/CUDAContext.h>
#include <c10/cuda/CUDAGuard.h>
#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <torch/extension.h>

namespace {

template <typename T> __device__ __forceinline__ float to_f(T v) { return static_cast<float>(v); }
template <> __device__ __forceinline__ float to_f(__nv_bfloat16 v) { return __bfloat162float(v); }
template <> __device__ __forceinline__ float to_f(__half v) { return __half2float(v); }

template <typename T> __device__ __forceinline__ T from_f(float v) { return static_cast<T>(v); }
template <> __device__ __forceinline__ __nv_bfloat16 from_f(float v) { return __float2bfloat16_rn(v); }
template <> __device__ __forceinline__ __half from_f(float v) { return __float2half_rn(v); }

template <typename S, typename D>
__global__ void scale_cast_kernel(const S* __restrict__ src, D* __restrict__ dst, int64_t n,
                                  float scale) {
  int64_t i = blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x;
  const int64_t stride = static_cast<int64_t>(gridDim.x) * blockDim.x;
  for (; i < n; i += stride) dst[i] = from_f<D>(to_f<S>(src[i]) * scale);
}

template <typename T> struct CudaType { using type = T; };
template <> struct CudaType<at::BFloat16> { using type = __nv_bfloat16; };
template <> struct CudaType<at::Half> { using type = __half; };

template <typename S>
void launch_for_src(const at::Tensor& src, at::Tensor& dst, double scale, cudaStream_t stream) {
  const int64_t n = src.numel();
  const int threads = 256;
  const int blocks = static_cast<int>(std::min<int64_t>((n + threads - 1) / threads, 4096));
  using SC = typename CudaType<S>::type;
  const SC* s = reinterpret_cast<const SC*>(src.data_ptr<S>());
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, dst.scalar_type(), "scale_cast_dst", [&] {
    using DC = typename CudaType<scalar_t>::type;
    scale_cast_kernel<SC, DC><<<blocks, threads, 0, stream>>>(
        s, reinterpret_cast<DC*>(dst.data_ptr<scalar_t>()), n, static_cast<float>(scale));
  });
}

void scale_cast(const at::Tensor& src, at::Tensor dst, double scale) {
  TORCH_CHECK(src.is_cuda() && dst.is_cuda(), "scale_cast: tensors must be on CUDA");
  TORCH_CHECK(src.is_contiguous() && dst.is_contiguous(), "scale_cast: tensors must be contiguous");
  TORCH_CHECK(src.numel() == dst.numel(), "scale_cast: size mismatch");
  if (src.numel() == 0) return;
  const c10::cuda::CUDAGuard guard(src.device());
  cudaStream_t stream = at::cuda::getCurrentCUDAStream();
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, src.scalar_type(), "scale_cast_src", [&] {
    launch_for_src<scalar_t>(src, dst, scale, stream);
  });
  C10_CUDA_KERNEL_LAUNCH_CHECK();
}

}  // namespace

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("scale_cast", &scale_cast, "dst = cast(src * scale), one pass on the GPU");
}
