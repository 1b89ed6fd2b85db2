// Test helper: device buffers that die with the test, and host<->device copies of any trivially
// copyable element type. Only for the CUDA tests (they skip without a device).
#ifndef FLUXION_KERNELS_CUDA_DEVICE_BUFFERS_TESTING_H_
#define FLUXION_KERNELS_CUDA_DEVICE_BUFFERS_TESTING_H_

#include <cuda_runtime.h>

#include <vector>

#include "gtest/gtest.h"

namespace fluxion::kernels::cuda {

class DeviceBuffers {
 public:
  DeviceBuffers() = default;
  DeviceBuffers(const DeviceBuffers&) = delete;
  DeviceBuffers& operator=(const DeviceBuffers&) = delete;
  ~DeviceBuffers() {
    for (void* b : buffers_) cudaFree(b);
  }

  template <typename T>
  T* ToDevice(const std::vector<T>& host) {
    void* d = nullptr;
    EXPECT_EQ(cudaMalloc(&d, std::max<size_t>(1, host.size()) * sizeof(T)), cudaSuccess);
    if (!host.empty()) {
      EXPECT_EQ(cudaMemcpy(d, host.data(), host.size() * sizeof(T), cudaMemcpyHostToDevice),
                cudaSuccess);
    }
    buffers_.push_back(d);
    return static_cast<T*>(d);
  }

  template <typename T>
  static std::vector<T> ToHost(const T* d, size_t n) {
    std::vector<T> h(n);
    EXPECT_EQ(cudaMemcpy(h.data(), d, n * sizeof(T), cudaMemcpyDeviceToHost), cudaSuccess);
    return h;
  }

 private:
  std::vector<void*> buffers_;
};

}  // namespace fluxion::kernels::cuda

#endif  // FLUXION_KERNELS_CUDA_DEVICE_BUFFERS_TESTING_H_
