// SPDX-License-Identifier: Apache-2.0
// Non-owning tensor views, and owning host buffers with optional memory accounting.
// A view's type names the memory space its pointer lives in (Kokkos's View<T, Space> is the model):
// TensorView<T> is host memory, TensorView<T, DeviceSpace> a device's. A view converts only within its
// space, so a device pointer cannot reach a host op, a host loop or a host copy without a compile
// error; element access exists only on host views. A backend names its space (`B::space`), and
// ViewOn<B, T> / ConstViewOn<B, T> are the views of that backend's memory.
#pragma once

#include <cmath>
#include <concepts>
#include <cstddef>
#include <limits>
#include <memory>
#include <span>
#include <string_view>
#include <type_traits>
#include <utility>

#include "cupipe/core/dtype.hpp"
#include "cupipe/core/error.hpp"
#include "cupipe/core/host_block_cache.hpp"
#include "cupipe/core/memory.hpp"
#include "cupipe/core/shape.hpp"

namespace cupipe {

/// Memory the host can read and write (also what Host backends allocate).
struct HostSpace {
  static constexpr std::string_view name = "host";
};
/// Memory of an accelerator (a CUDA device); the host reaches it only through its backend.
struct DeviceSpace {
  static constexpr std::string_view name = "device";
};

/// Whether the host can read memory of this space directly.
template <class Space> inline constexpr bool host_accessible = std::is_same_v<Space, HostSpace>;

template <class T, class Space = HostSpace>
class TensorView {
 public:
  using value_type = std::remove_const_t<T>;
  using space = Space;

  constexpr TensorView() = default;
  constexpr TensorView(T* data, Shape shape) : data_(data), shape_(shape) {}
  /// A mutable view converts to a read-only one of the same space.
  template <class U>
    requires(std::is_const_v<T> && std::is_same_v<const U, T>)
  constexpr TensorView(TensorView<U, Space> other) : data_(other.data()), shape_(other.shape()) {}

  constexpr T* data() const noexcept { return data_; }
  constexpr const Shape& shape() const noexcept { return shape_; }
  constexpr index_t numel() const noexcept { return shape_.numel(); }
  constexpr index_t rows() const noexcept { return shape_.rows(); }
  constexpr index_t cols() const noexcept { return shape_.cols(); }
  /// True for a default (null) view or one with no elements.
  constexpr bool empty() const noexcept { return data_ == nullptr || numel() == 0; }
  /// Element access, on host views only.
  constexpr T& operator[](index_t i) const noexcept
    requires host_accessible<Space>
  {
    return data_[i];
  }
  constexpr T& at(index_t row, index_t col) const noexcept
    requires host_accessible<Space>
  {
    return data_[row * cols() + col];
  }

  /// The same memory seen with another shape of the same element count.
  TensorView reshaped(Shape shape) const {
    CUPIPE_REQUIRE(shape.numel() == numel(), "cannot reshape ", shape_, " to ", shape);
    return {data_, shape};
  }
  /// Rows [first, first + count) of the 2-D view.
  TensorView row_slice(index_t first, index_t count) const {
    CUPIPE_REQUIRE(first >= 0 && count >= 0 && first + count <= rows(), "rows [", first, ", ",
                   first + count, ") out of range for ", shape_);
    return {data_ + first * cols(), Shape{count, cols()}};
  }

 private:
  T* data_ = nullptr;
  Shape shape_{};
};

/// A read-only view. The element type is not deduced from it (it sits in a non-deduced context), so
/// an op templated on T accepts a mutable TensorView<T> where it asks for ConstView<T>, with T
/// taken from the backend argument.
template <class T, class Space = HostSpace> using ConstView = std::type_identity_t<TensorView<const T, Space>>;
/// Views of backend B's memory (B::space): what layers and the runtime pass to B's ops. ViewOn
/// deduces T (from a view of exactly that type); ConstViewOn, like ConstView, does not.
template <class B, class T> using ViewOn = TensorView<T, typename B::space>;
/// The element type of gradients, master weights and optimizer state on backend B: its compute type
/// (float for bf16 storage; the storage type itself otherwise).
template <class B> using grad_t = typename B::compute_type;
template <class B, class T> using ConstViewOn = std::type_identity_t<TensorView<const T, typename B::space>>;
/// Views of a device's memory: what the CUDA backend's ops take.
template <class T> using DeviceView = TensorView<T, DeviceSpace>;
template <class T> using DeviceConstView = std::type_identity_t<TensorView<const T, DeviceSpace>>;
/// A scalar argument whose type is not deduced (taken from the backend): `axpy(be, 1.0, x, y)` works for float.
template <class T> using Scalar = std::type_identity_t<T>;

/// Checks that `view` is non-null (when non-empty) and has exactly `expected` shape; the message
/// names `who` (a layer or op) and both shapes.
template <class T, class Space>
void check_view(const TensorView<T, Space>& view, const Shape& expected, std::string_view who,
                std::string_view what) {
  if (!(view.shape() == expected))
    CUPIPE_THROW(who, ": ", what, " expected shape ", expected, " but got ", view.shape());
  if (view.data() == nullptr && expected.numel() != 0)
    CUPIPE_THROW(who, ": ", what, " of shape ", expected, " is a null pointer");
}
/// The same, with `who` made only when the check fails (a name built per call would cost a heap
/// allocation on every pass of the hot path).
template <class T, class Space, std::invocable Who>
void check_view(const TensorView<T, Space>& view, const Shape& expected, Who&& who, std::string_view what) {
  if (!(view.shape() == expected) || (view.data() == nullptr && expected.numel() != 0)) [[unlikely]]
    check_view(view, expected, std::string_view(who()), what);
}

/// An owning host array, zero-initialised unless the constructor is told otherwise (BlockFill),
/// optionally accounted to a MemoryTracker under a tag.
/// Large arrays come from HostBlockCache, so a step that frees and reallocates its activations
/// reuses the same pages instead of faulting in fresh ones.
template <class T>
class HostBuffer {
  static_assert(std::is_trivially_copyable_v<T>, "HostBuffer holds trivially copyable values (zeroed bytes)");
  static_assert(alignof(T) <= HostBlockCache::alignment, "HostBuffer's blocks are aligned to 64 bytes");

 public:
  HostBuffer() = default;
  explicit HostBuffer(index_t count, MemoryTracker* tracker = nullptr, MemoryTag tag = MemoryTag::workspace,
                      BlockFill fill = BlockFill::zero)
      : size_(count), tracker_(tracker), tag_(tag) {
    CUPIPE_REQUIRE(count >= 0, "negative buffer size ", count);
    CUPIPE_REQUIRE(std::size_t(count) <= std::size_t(std::numeric_limits<std::ptrdiff_t>::max()) / sizeof(T), "buffer of ",
                   count, " elements of ", sizeof(T), " bytes is larger than any address space");
    if (count) data_ = static_cast<T*>(HostBlockCache::instance().allocate(bytes(), fill));
    if (tracker_) tracker_->allocate(tag_, bytes());
  }
  HostBuffer(HostBuffer&& other) noexcept { swap(other); }
  HostBuffer& operator=(HostBuffer&& other) noexcept {
    HostBuffer(std::move(other)).swap(*this);
    return *this;
  }
  HostBuffer(const HostBuffer&) = delete;
  HostBuffer& operator=(const HostBuffer&) = delete;
  ~HostBuffer() {
    if (tracker_) tracker_->release(tag_, bytes());
    if (data_) HostBlockCache::instance().release(data_, bytes());
  }

  void swap(HostBuffer& other) noexcept {
    std::swap(data_, other.data_);
    std::swap(size_, other.size_);
    std::swap(tracker_, other.tracker_);
    std::swap(tag_, other.tag_);
  }

  T* data() noexcept { return data_; }
  const T* data() const noexcept { return data_; }
  index_t size() const noexcept { return size_; }
  std::size_t bytes() const noexcept { return static_cast<std::size_t>(size_) * sizeof(T); }
  T& operator[](index_t i) noexcept { return data_[i]; }
  const T& operator[](index_t i) const noexcept { return data_[i]; }
  std::span<T> span() noexcept { return {data(), static_cast<std::size_t>(size_)}; }
  std::span<const T> span() const noexcept { return {data(), static_cast<std::size_t>(size_)}; }

  /// A view of the first shape.numel() elements; throws if the buffer is too small.
  TensorView<T> view(Shape shape) {
    CUPIPE_REQUIRE(shape.numel() <= size_, "buffer of ", size_, " elements is too small for shape ", shape);
    return {data(), shape};
  }
  ConstView<T> view(Shape shape) const {
    CUPIPE_REQUIRE(shape.numel() <= size_, "buffer of ", size_, " elements is too small for shape ", shape);
    return {data(), shape};
  }

 private:
  T* data_ = nullptr;
  index_t size_ = 0;
  MemoryTracker* tracker_ = nullptr;
  MemoryTag tag_ = MemoryTag::workspace;
};

/// True when every element of a host array is finite.
template <class T>
bool all_finite(std::span<const T> values) {
  for (const T& v : values)
    if (!std::isfinite(static_cast<double>(v))) return false;
  return true;
}

}  // namespace cupipe
