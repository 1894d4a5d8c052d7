// Shared by pdserve's CPU kernels: float <-> storage-type conversions that the compiler vectorises. Loops over
// c10::BFloat16 values stay scalar (a struct per element, and c10's rounding branches on NaN), so kernels read and
// write bfloat16 as its raw 16 bits and convert with the same arithmetic as c10 (round to nearest even,
// NaN -> 0x7FC0) in branch-free bit operations. Use: S = storage_t<T>, p = raw(tensor.data_ptr<T>()),
// to_f<T>(p[i]) and p[i] = from_f<T>(x). Also the prefetch of weight rows that the streaming kernels share.
#pragma once

#include <c10/util/BFloat16.h>

#include <cstdint>
#include <cstring>
#include <type_traits>

namespace pdserve_kernels {

template <typename T>
struct Storage {
  using type = T;
};

template <>
struct Storage<c10::BFloat16> {
  using type = uint16_t;
};

template <typename T>
using storage_t = typename Storage<T>::type;

template <typename T>
inline storage_t<T>* raw(T* p) {
  return reinterpret_cast<storage_t<T>*>(p);
}

template <typename T>
inline const storage_t<T>* raw(const T* p) {
  return reinterpret_cast<const storage_t<T>*>(p);
}

template <typename T>
inline float to_f(storage_t<T> x) {
  if constexpr (std::is_same_v<T, c10::BFloat16>) {
    const uint32_t u = static_cast<uint32_t>(x) << 16;
    float f;
    std::memcpy(&f, &u, sizeof f);
    return f;
  } else {
    return static_cast<float>(x);
  }
}

template <typename T>
inline storage_t<T> from_f(float x) {
  if constexpr (std::is_same_v<T, c10::BFloat16>) {
    uint32_t u;
    std::memcpy(&u, &x, sizeof u);
    const uint32_t rounded = (u + 0x7FFFu + ((u >> 16) & 1u)) >> 16;
    const bool nan = (u & 0x7FFFFFFFu) > 0x7F800000u;
    return static_cast<uint16_t>(nan ? 0x7FC0u : rounded);
  } else {
    return static_cast<T>(x);
  }
}

// Weight rows ahead of the ones being summed, into every cache level: decode streams each weight once.
template <typename S>
inline void prefetch_rows(const S* p, int64_t elems) {
  const char* c = reinterpret_cast<const char*>(p);
  for (int64_t b = 0; b < elems * static_cast<int64_t>(sizeof(S)); b += 64) __builtin_prefetch(c + b, 0, 3);
}

}  // namespace pdserve_kernels
