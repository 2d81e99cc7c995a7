// SPDX-License-Identifier: Apache-2.0
// Element types, their sizes and their safetensors names; a host bfloat16 for storage and reference.
#pragma once

#include <bit>
#include <cstdint>
#include <cstring>
#include <string_view>

namespace cupipe {

enum class DType : std::uint8_t { f32, f64, bf16, f16, i32, i64, u8 };

/// Host-side bfloat16: storage and round-to-nearest-even conversion, no arithmetic.
struct bfloat16 {
  std::uint16_t bits = 0;

  bfloat16() = default;
  explicit bfloat16(float value) noexcept {
    std::uint32_t u = std::bit_cast<std::uint32_t>(value);
    if ((u & 0x7fffffffu) > 0x7f800000u) {  // NaN stays a quiet NaN
      bits = static_cast<std::uint16_t>((u >> 16) | 0x40u);
      return;
    }
    u += 0x7fffu + ((u >> 16) & 1u);
    bits = static_cast<std::uint16_t>(u >> 16);
  }
  explicit operator float() const noexcept { return std::bit_cast<float>(std::uint32_t(bits) << 16); }
};

template <class T> struct dtype_of;
template <> struct dtype_of<float> { static constexpr DType value = DType::f32; };
template <> struct dtype_of<double> { static constexpr DType value = DType::f64; };
template <> struct dtype_of<bfloat16> { static constexpr DType value = DType::bf16; };
template <> struct dtype_of<std::int32_t> { static constexpr DType value = DType::i32; };
template <> struct dtype_of<std::int64_t> { static constexpr DType value = DType::i64; };
template <> struct dtype_of<std::uint8_t> { static constexpr DType value = DType::u8; };
template <class T> inline constexpr DType dtype_v = dtype_of<T>::value;

constexpr std::size_t size_of(DType type) noexcept {
  switch (type) {
    case DType::f32: case DType::i32: return 4;
    case DType::f64: case DType::i64: return 8;
    case DType::bf16: case DType::f16: return 2;
    case DType::u8: return 1;
  }
  return 0;
}

/// The dtype's name as safetensors writes it ("F32", "BF16", ...).
constexpr std::string_view name(DType type) noexcept {
  switch (type) {
    case DType::f32: return "F32";
    case DType::f64: return "F64";
    case DType::bf16: return "BF16";
    case DType::f16: return "F16";
    case DType::i32: return "I32";
    case DType::i64: return "I64";
    case DType::u8: return "U8";
  }
  return "?";
}

/// Parses a safetensors dtype name; returns false for names cupipe does not handle.
constexpr bool parse_dtype(std::string_view text, DType& out) noexcept {
  for (DType t : {DType::f32, DType::f64, DType::bf16, DType::f16, DType::i32, DType::i64, DType::u8})
    if (name(t) == text) {
      out = t;
      return true;
    }
  return false;
}

}  // namespace cupipe
