// SPDX-License-Identifier: Apache-2.0
// How a mixture-of-experts layer's tokens travel under expert parallelism (moe/expert_group.hpp), in
// host memory. A rank has routed its n rows and sorted its kept slots by expert (moe::dispatch), so
// the slots for rank q's experts are one contiguous run of that order. Before each all-to-all the
// ranks exchange, for every pair, a header and the slots' count per expert of the receiver; the
// header (experts, top-k, width, rows) must agree on every rank, or the layer fails at once naming
// the two ranks, instead of sending a shape the receiver does not expect.
//
// A receiver gets its slots source by source (rank order), each source's sorted by expert; it runs
// each expert over that expert's slots from every source, so it reorders them expert by expert
// (expert-major: expert 0's slots from rank 0, rank 1, ..., then expert 1's), and back. The slots a
// rank sends itself need no transfer: it runs them while the all-to-all moves the others
// (expert_rows, place_own), and the layer times what each all-to-all leaves exposed (Transfer).
#pragma once

#include <algorithm>
#include <chrono>
#include <cstdint>
#include <string>
#include <vector>

#include "cupipe/core/error.hpp"
#include "cupipe/core/shape.hpp"
#include "cupipe/comm/turns.hpp"
#include "cupipe/moe/expert_group.hpp"
#include "cupipe/moe/tally.hpp"

namespace cupipe::moe {

/// What a rank receives in one microbatch's exchange: `counts[q * local + e]` slots from rank q for
/// its local expert e (E / ranks experts of its own), and what it sends each rank.
struct ExchangeCounts {
  int ranks = 1;
  index_t local = 0;                 ///< experts per rank
  std::vector<index_t> counts;       ///< ranks x local: received, per source and local expert
  std::vector<index_t> sent;         ///< ranks: slots sent to each rank
  index_t received() const {
    index_t total = 0;
    for (index_t c : counts) total += c;
    return total;
  }
  index_t from(int q) const {
    index_t total = 0;
    for (index_t e = 0; e < local; ++e) total += counts[std::size_t(q * local + e)];
    return total;
  }
  index_t for_expert(index_t e) const {
    index_t total = 0;
    for (int q = 0; q < ranks; ++q) total += counts[std::size_t(q * local + e)];
    return total;
  }
};

/// Header values that precede the counts in each message of the exchange.
inline constexpr std::size_t exchange_header = 4;

/// Runs `call`, adding its wall time in seconds to `*seconds` (when given).
template <class Call>
void timed(double* seconds, Call&& call) {
  const auto start = std::chrono::steady_clock::now();
  call();
  if (seconds) *seconds += std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
}

/// The counts' exchange of a layer of `experts` experts, top-`top_k`, rows of `width` values, with
/// `rows` rows here whose kept slots, sorted by expert, begin at `offsets` (experts + 1): every rank
/// calls it (a collective over `group`). Throws, naming the ranks, where a rank's header differs.
/// The exchange's wall time is added to `*seconds` (when given).
inline ExchangeCounts exchange_counts(ExpertGroup& group, const index_t* offsets, index_t experts, index_t top_k, index_t width,
                                      index_t rows, const std::string& layer, double* seconds = nullptr) {
  const int P = group.size();
  CUPIPE_REQUIRE(P >= 1 && experts % P == 0, layer, ": ", experts, " experts do not split over ", group.name());
  ExchangeCounts out{P, experts / P, {}, {}};
  const std::size_t per = exchange_header + std::size_t(out.local);
  std::vector<std::int64_t> send(per * std::size_t(P)), receive(send.size());
  out.sent.assign(std::size_t(P), 0);
  for (int q = 0; q < P; ++q) {
    std::int64_t* m = send.data() + per * std::size_t(q);
    m[0] = experts;
    m[1] = top_k;
    m[2] = width;
    m[3] = rows;
    for (index_t e = 0; e < out.local; ++e) {
      const index_t g = index_t(q) * out.local + e;
      m[exchange_header + std::size_t(e)] = offsets[g + 1] - offsets[g];
    }
    out.sent[std::size_t(q)] = offsets[index_t(q + 1) * out.local] - offsets[index_t(q) * out.local];
  }
  timed(seconds, [&] { group.exchange_counts(send.data(), receive.data(), per); });
  const char* what[] = {"experts", "top-k", "row width", "rows in the microbatch"};
  out.counts.assign(std::size_t(P) * std::size_t(out.local), 0);
  for (int q = 0; q < P; ++q) {
    const std::int64_t* m = receive.data() + per * std::size_t(q);
    for (std::size_t i = 0; i < exchange_header; ++i)
      if (m[i] != send[i])
        CUPIPE_THROW(layer, ": rank ", q, " of ", group.name(), " runs this layer's exchange with ", m[i], " ", what[i],
                     " but rank ", group.rank(), " with ", send[i],
                     "; every rank of the group must run the same model with microbatches of the same size");
    for (index_t e = 0; e < out.local; ++e) {
      const std::int64_t c = m[exchange_header + std::size_t(e)];
      CUPIPE_REQUIRE(c >= 0 && c <= rows * top_k, layer, ": rank ", q, " of ", group.name(), " announced ", c,
                     " slots for one expert, outside 0 .. ", rows * top_k);
      out.counts[std::size_t(q * out.local + e)] = index_t(c);
    }
  }
  return out;
}

/// Where each (source q, local expert e) block starts in expert-major order, at q x local + e.
inline std::vector<index_t> expert_major_starts(const ExchangeCounts& c) {
  std::vector<index_t> at(c.counts.size());
  index_t next = 0;
  for (index_t e = 0; e < c.local; ++e)
    for (int q = 0; q < c.ranks; ++q) {
      at[std::size_t(q * c.local + e)] = next;
      next += c.counts[std::size_t(q * c.local + e)];
    }
  return at;
}

/// Copies `count` values from `from` to `to` in host memory: how reorder() and place_own() move rows
/// unless given the backend's copy (a device's rows stay on the device).
struct HostCopy {
  template <class T>
  void operator()(const T* from, T* to, index_t count) const {
    std::copy_n(from, count, to);
  }
};

/// Reorders `width`-wide rows received source by source (`from`) into expert-major order (`to`),
/// or back with `back`; `copy(from, to, values)` moves each block.
template <class T, class Copy = HostCopy>
void reorder(const ExchangeCounts& c, const T* from, T* to, index_t width, bool back = false, Copy copy = {}) {
  std::vector<index_t> source_major(c.counts.size());
  index_t at = 0;
  for (std::size_t i = 0; i < c.counts.size(); ++i) source_major[i] = (at += c.counts[i]) - c.counts[i];
  const std::vector<index_t> expert_major = expert_major_starts(c);
  for (std::size_t i = 0; i < c.counts.size(); ++i) {
    const index_t a = back ? expert_major[i] : source_major[i], b = back ? source_major[i] : expert_major[i];
    if (c.counts[i] > 0) copy(from + a * width, to + b * width, c.counts[i] * width);
  }
}

/// Value counts (rows x width) of an all-to-all: `sent` rows to each rank (forward) or, with
/// `returning`, the rows received from each rank going back.
inline std::vector<std::int64_t> value_counts(const ExchangeCounts& c, index_t width, bool returning) {
  std::vector<std::int64_t> v(std::size_t(c.ranks));
  for (int q = 0; q < c.ranks; ++q) v[std::size_t(q)] = std::int64_t((returning ? c.from(q) : c.sent[std::size_t(q)]) * width);
  return v;
}

/// Rows [first, first + rows) of the received slots in expert-major order, all for local expert
/// `expert`: what one run of that expert's two GEMMs takes.
struct ExpertRows {
  index_t expert = 0, first = 0, rows = 0;
};

/// The expert-major runs of the slots from rank `source` alone (`own`), or from every other rank
/// (two runs an expert: the ranks before it and after it), or, with `source` < 0, from every rank.
inline std::vector<ExpertRows> expert_rows(const ExchangeCounts& c, int source, bool own) {
  const std::vector<index_t> at = expert_major_starts(c);
  std::vector<ExpertRows> out;
  const auto run = [&](index_t e, int from, int to) {  // ranks [from, to)
    index_t rows = 0;
    for (int q = from; q < to; ++q) rows += c.counts[std::size_t(q * c.local + e)];
    if (rows > 0) out.push_back({e, at[std::size_t(from * c.local + e)], rows});
  };
  for (index_t e = 0; e < c.local; ++e) {
    if (source < 0) run(e, 0, c.ranks);
    else if (own) run(e, source, source + 1);
    else {
      run(e, 0, source);
      run(e, source + 1, c.ranks);
    }
  }
  return out;
}

/// Copies the slots rank `source` sent itself (`sorted`: its slots for its own experts, sorted by
/// expert, `width` wide) to their expert-major places in `to`, as the all-to-all will deliver them;
/// `copy(from, to, values)` moves each block.
template <class T, class Copy = HostCopy>
void place_own(const ExchangeCounts& c, int source, const T* sorted, T* to, index_t width, Copy copy = {}) {
  const std::vector<index_t> at = expert_major_starts(c);
  index_t from = 0;
  for (index_t e = 0; e < c.local; ++e) {
    const std::size_t i = std::size_t(source * c.local + e);
    if (c.counts[i] > 0) copy(sorted + from * width, to + at[i] * width, c.counts[i] * width);
    from += c.counts[i];
  }
}

/// One all-to-all of the group, started and finished, and what it cost, added to `tally` (when
/// given): the wall time from its start to its end (in flight) and the part of it the caller spent
/// blocked in the group's calls (exposed). Where the caller is one of a pair of actions that take
/// turns (pipeline/paired_turns.hpp), finish() first lets the paired action compute while the
/// tokens travel, and counts the all-to-all as one its partner ran beside. One left open by an
/// exception is finished by the destructor (its errors dropped), so that no buffer it reads or
/// writes is freed under it: declare it after those buffers.
class Transfer {
 public:
  Transfer(ExpertGroup& group, Tally* tally) : group_(group), tally_(tally) {}
  Transfer(const Transfer& o) : group_(o.group_), tally_(o.tally_) {}
  Transfer& operator=(const Transfer&) = delete;
  ~Transfer() {
    if (!open_) return;
    try {
      group_.finish_all_to_all();
    } catch (...) {  // the error that unwinds the caller is the one to report
    }
  }
  template <class T>
  void start(const T* send, const std::vector<std::int64_t>& send_counts, T* receive,
             const std::vector<std::int64_t>& receive_counts) {
    started_ = std::chrono::steady_clock::now();
    timed(exposed(), [&] { group_.start_all_to_all(send, send_counts.data(), receive, receive_counts.data()); });
    open_ = true;
  }
  void finish() {
    const bool beside = comm::let_partner_run();
    open_ = false;
    timed(exposed(), [&] { group_.finish_all_to_all(); });
    if (tally_) {
      tally_->all_to_all_seconds += std::chrono::duration<double>(std::chrono::steady_clock::now() - started_).count();
      tally_->all_to_alls += 1;
      tally_->all_to_alls_beside_partner += beside ? 1 : 0;
    }
  }

 private:
  double* exposed() const { return tally_ ? &tally_->exposed_all_to_all_seconds : nullptr; }

  ExpertGroup& group_;
  Tally* tally_;
  std::chrono::steady_clock::time_point started_{};
  bool open_ = false;
};

}  // namespace cupipe::moe
