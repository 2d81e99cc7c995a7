// SPDX-License-Identifier: Apache-2.0
// Where two actions of one worker take turns on one thread of compute (pipeline/paired_turns.hpp:
// DualPipeV's overlapped F&B pair on the host), the point at which one hands its turn to the other:
// code that has started communication and is about to wait for it calls let_partner_run(), and the
// paired action computes while the communication is in flight. Outside such a pair it does nothing.
// The mixture-of-experts layers call it before each all-to-all's wait (moe::Transfer::finish).
#pragma once

namespace cupipe::comm {

/// The action on this thread's side of a pair that takes turns.
class TurnPartner {
 public:
  /// Hands the turn to the paired action and returns once it is this thread's turn again: true where
  /// the partner ran meanwhile, false where it had already ended (nothing to run).
  virtual bool hand_over() = 0;

 protected:
  ~TurnPartner() = default;
};

namespace detail {
/// The pair this thread's action belongs to (null: none). Set by pipeline::PairedTurns.
inline thread_local TurnPartner* turn_partner = nullptr;
}  // namespace detail

/// Lets the paired action run while this thread's communication is in flight; true where it ran.
/// Call it after starting the communication and before waiting for it. Every rank that shares the
/// communication runs the same code, so each hands over at the same points.
inline bool let_partner_run() { return detail::turn_partner != nullptr && detail::turn_partner->hand_over(); }

}  // namespace cupipe::comm
