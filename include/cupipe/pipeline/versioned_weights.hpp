// SPDX-License-Identifier: Apache-2.0
// VersionedWeights: the parameter versions one stage holds. Version ids count the updates applied to
// the stage; a microbatch runs its forward and backward with the version it was assigned when it
// entered the pipeline (vertical sync), so a stage keeps every version some unfinished microbatch
// still needs, and recycles the rest. K is the most versions the schedule policy allows at once: 1
// for flush schedules, 2 for PipeDream-2BW, dynamic_versions for PipeDream (the verifier's count
// for the stage is then given at run time). Holding more is a bug, and throws.
#pragma once

#include <algorithm>
#include <string>
#include <vector>

#include "cupipe/core/error.hpp"
#include "cupipe/core/memory.hpp"
#include "cupipe/core/tensor.hpp"

namespace cupipe {

inline constexpr int dynamic_versions = -1;

template <class Backend, int K>
class VersionedWeights {
  static_assert(K == dynamic_versions || K >= 1, "VersionedWeights<Backend, K>: K is at least 1");

 public:
  using T = typename Backend::value_type;
  using buffer_type = typename Backend::template buffer<T>;

  /// Version 0, allocated on `backend` and left for the caller to fill.
  VersionedWeights(Backend& backend, index_t count, int capacity = K)
      : backend_(&backend), count_(count), capacity_(K == dynamic_versions ? capacity : K) {
    CUPIPE_REQUIRE(capacity_ >= 1, "VersionedWeights: capacity ", capacity_, " is below 1");
    versions_.push_back({0, backend.template allocate<T>(count, MemoryTag::weights)});
  }

  int latest() const noexcept { return versions_.back().id; }
  int oldest() const noexcept { return versions_.front().id; }
  int live() const noexcept { return int(versions_.size()); }
  int peak_live() const noexcept { return peak_live_; }
  int capacity() const noexcept { return capacity_; }
  index_t count() const noexcept { return count_; }

  T* data(int version) {
    require_held();
    for (auto& v : versions_)
      if (v.id == version) return v.data.data();
    CUPIPE_THROW("weight version ", version, " is not held (held: ", oldest(), "..", latest(), ")");
  }
  T* latest_data() {
    require_held();
    return versions_.back().data.data();
  }

  /// ZeRO-3 (pipeline/parameter_shards.hpp): whether the one version's values are held; release()
  /// frees them (the version id stays), hold() allocates them again for a gather to fill.
  bool held() const noexcept { return !released_; }
  void release() {
    CUPIPE_REQUIRE(live() == 1, "VersionedWeights: a stage holding ", live(), " weight versions cannot release them");
    versions_.back().data = buffer_type();
    released_ = true;
  }
  void hold() {
    if (!released_) return;
    versions_.back().data = backend_->template allocate<T>(count_, MemoryTag::weights);
    released_ = false;
  }

  /// Makes version latest+1 as a copy of the latest and returns it for the caller to update.
  T* advance() {
    require_held();
    if (live() + 1 > capacity_)
      CUPIPE_THROW("a stage would hold ", live() + 1, " weight versions (", oldest(), "..", latest() + 1,
                   ") but its schedule allows ", capacity_);
    Version next{latest() + 1, backend_->template allocate<T>(count_, MemoryTag::weights)};
    copy(*backend_, ConstViewOn<Backend, T>{latest_data(), Shape{count_}}, ViewOn<Backend, T>{next.data.data(), Shape{count_}});
    versions_.push_back(std::move(next));
    peak_live_ = std::max(peak_live_, live());
    return versions_.back().data.data();
  }

  /// Renames the latest version to latest+1 for an update in place: nothing needs the old one.
  T* advance_in_place() {
    ++versions_.back().id;
    return versions_.back().data.data();
  }

  /// Frees every version older than `version`, never the latest.
  void drop_below(int version) {
    while (versions_.size() > 1 && versions_.front().id < version) versions_.erase(versions_.begin());
  }

  void reset_peak() noexcept { peak_live_ = live(); }

 private:
  struct Version {
    int id;
    buffer_type data;
  };

  void require_held() const {
    if (released_)
      CUPIPE_THROW("weight version ", latest(), " is released (ZeRO-3 keeps this stage's parameters as shards); "
                   "gather them first");
  }

  Backend* backend_;
  index_t count_;
  bool released_ = false;
  int capacity_;
  std::vector<Version> versions_;
  int peak_live_ = 1;
};

}  // namespace cupipe
