// SPDX-License-Identifier: Apache-2.0
// Parameter names composed at compile time, so that layers built from layers keep PyTorch's
// state_dict names: Named<"ln_1", LayerNorm<C>> has parameters "ln_1.weight" and "ln_1.bias", and a
// Residual names its inner layers' parameters "<index>.<name>", or by their Named name.
// ParamSpec holds a string_view, so the composed names live in static storage built here.
#pragma once

#include <array>
#include <cstddef>
#include <string>
#include <string_view>

#include "cupipe/layers/layer.hpp"

namespace cupipe {

/// A string literal as a template argument: Named<"attn", ...>.
template <std::size_t N>
struct fixed_string {
  char chars[N]{};
  constexpr fixed_string(const char (&s)[N]) {  // NOLINT: implicit, so that "name" converts
    for (std::size_t i = 0; i < N; ++i) chars[i] = s[i];
  }
  constexpr std::string_view view() const { return {chars, N - 1}; }
};

namespace detail {

/// One parameter of a composed layer: its name is `prefix.` or `index.` (index >= 0) then `name`.
struct NameEntry {
  std::string_view prefix;
  int index = -1;
  std::string_view name;
  index_t rows = 0, cols = 0;
  TensorSplit split = TensorSplit::none;
  int parts = 1;
};

constexpr std::size_t decimal_digits(int v) {
  std::size_t n = 1;
  while (v >= 10) v /= 10, ++n;
  return n;
}
constexpr std::size_t entry_length(const NameEntry& e) {
  const std::size_t head = e.index >= 0 ? decimal_digits(e.index) + 1 : e.prefix.empty() ? 0 : e.prefix.size() + 1;
  return head + e.name.size();
}

/// Source::entries (a static constexpr std::array<NameEntry, N>) as ParamSpecs whose names point
/// into `storage`.
template <class Source>
struct joined_names {
  static constexpr auto& entries = Source::entries;
  static constexpr std::size_t count = entries.size();
  static constexpr std::size_t chars = [] {
    std::size_t n = 0;
    for (const NameEntry& e : entries) n += entry_length(e);
    return n;
  }();
  static constexpr std::array<char, chars + 1> storage = [] {
    std::array<char, chars + 1> out{};
    std::size_t at = 0;
    for (const NameEntry& e : entries) {
      if (e.index >= 0) {
        const std::size_t digits = decimal_digits(e.index);
        for (std::size_t d = 0, v = std::size_t(e.index); d < digits; ++d, v /= 10) out[at + digits - 1 - d] = char('0' + v % 10);
        at += digits;
        out[at++] = '.';
      } else if (!e.prefix.empty()) {
        for (char c : e.prefix) out[at++] = c;
        out[at++] = '.';
      }
      for (char c : e.name) out[at++] = c;
    }
    return out;
  }();
  static constexpr std::array<ParamSpec, count> specs = [] {
    std::array<ParamSpec, count> out{};
    std::size_t at = 0;
    for (std::size_t i = 0; i < count; ++i) {
      const std::size_t n = entry_length(entries[i]);
      out[i] = ParamSpec{std::string_view(storage.data() + at, n), entries[i].rows, entries[i].cols, entries[i].split,
                         entries[i].parts};
      at += n;
    }
    return out;
  }();
};

/// The width a layer's parameter names are read at (names never depend on it).
template <class L>
inline constexpr index_t naming_width = L::in_features == any_features ? 1 : L::in_features;

template <fixed_string Name, class L>
struct prefixed_entries {
  static constexpr auto inner = L::params(naming_width<L>);
  static constexpr auto entries = [] {
    std::array<NameEntry, inner.size()> out{};
    for (std::size_t i = 0; i < inner.size(); ++i)
      out[i] = {Name.view(), -1, inner[i].name, inner[i].rows, inner[i].cols, inner[i].split, inner[i].parts};
    return out;
  }();
};

}  // namespace detail

/// Layer L under a name: its parameters are "<Name>.<L's names>" (nanoGPT's "ln_1.weight",
/// "attn.c_attn.weight"); everything else is L's. Inside a Residual, a Named layer's parameters keep
/// their name instead of taking the layer's index.
template <fixed_string Name, class L>
struct Named : L {
  static constexpr std::string_view layer_name = Name.view();
  static constexpr const auto& params(index_t) { return detail::joined_names<detail::prefixed_entries<Name, L>>::specs; }
  static std::string describe() { return std::string(layer_name) + ": " + L::describe(); }
};

template <fixed_string Name, class L>
struct whole_layer<Named<Name, L>> {
  using type = Named<Name, whole_layer_t<L>>;
};

template <fixed_string Name, class L>
struct passes_of<Named<Name, L>> : passes_of<L> {};

/// Whether L is a Named layer.
template <class L>
inline constexpr bool is_named = requires { L::layer_name; };

}  // namespace cupipe
