// SPDX-License-Identifier: Apache-2.0
// How the ranks of an NcclCommunicator (comm/nccl.hpp) come to share NCCL communicators: the
// world's unique id is made by rank 0 and reaches the others through MPI (from_mpi) or through a
// file every rank can read (from_environment, for launchers without MPI); every group (replicas,
// pipeline, tensor, the two-rank channels) is then split from the world communicator
// (ncclCommSplit, NCCL >= 2.18), or, on an older NCCL, made with ncclCommInitRank from a unique id
// of its own that the same bootstrap exchanges (IdExchange). Built only with CUPIPE_HAS_NCCL.
#pragma once

#include <nccl.h>

#include <cstddef>
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <functional>
#include <span>
#include <string>

#if defined(CUPIPE_HAS_MPI)
#include <mpi.h>
#endif

#include "cupipe/comm/nccl_check.hpp"
#include "cupipe/comm/wait.hpp"
#include "cupipe/core/error.hpp"
#include "cupipe/io/atomic_file.hpp"

namespace cupipe::comm {

/// How ranks agree on a unique id for a group when communicators cannot be split: every rank of
/// the world calls it with the same name, its group's color (or -1 outside any group) and whether
/// it is the group's root; the root makes the id, the other members get it.
using IdExchange = std::function<ncclUniqueId(const std::string& name, int color, bool root, const ncclUniqueId& made)>;

namespace detail {

#if defined(CUPIPE_HAS_MPI)
/// The exchange over MPI: a group's members form an MPI communicator of their own (split from
/// `comm`, where this process is `rank`), and its root broadcasts.
inline IdExchange mpi_id_exchange(MPI_Comm comm, int rank) {
  return [comm, rank](const std::string&, int color, bool root, const ncclUniqueId& made) {
    MPI_Comm sub = MPI_COMM_NULL;
    CUPIPE_REQUIRE(MPI_Comm_split(comm, color < 0 ? MPI_UNDEFINED : color, root ? -1 : rank, &sub) == MPI_SUCCESS,
                   "NcclCommunicator: MPI_Comm_split for a unique id exchange failed");
    ncclUniqueId out = made;
    if (sub != MPI_COMM_NULL) {
      const int rc = MPI_Bcast(&out, int(sizeof out), MPI_BYTE, 0, sub);
      MPI_Comm_free(&sub);
      CUPIPE_REQUIRE(rc == MPI_SUCCESS, "NcclCommunicator: MPI_Bcast of a group's unique id failed");
    }
    return out;
  };
}
#endif

/// A non-negative integer the launcher puts in the environment (RANK, WORLD_SIZE).
inline int environment_int(const char* name) {
  const char* value = std::getenv(name);
  CUPIPE_REQUIRE(value && *value, "NcclCommunicator::from_environment: ", name, " is not set (the launcher sets RANK "
                                  "and WORLD_SIZE; set them by hand otherwise)");
  char* end = nullptr;
  const long parsed = std::strtol(value, &end, 10);
  CUPIPE_REQUIRE(end && *end == '\0' && parsed >= 0, "NcclCommunicator::from_environment: ", name, "='", value,
                 "' is not a non-negative integer");
  return int(parsed);
}

/// The root writes `id` to `path` atomically; the others poll until the file appears.
inline ncclUniqueId share_id_through_file(const std::filesystem::path& path, bool root, const ncclUniqueId& id,
                                          double timeout_seconds) {
  if (root) {
    io::write_file_atomically(path, std::span<const std::byte>(reinterpret_cast<const std::byte*>(&id), sizeof id));
    return id;
  }
  ncclUniqueId out{};
  const bool found = wait_until(
      [&] {
        std::ifstream in(path, std::ios::binary);
        return in && in.read(reinterpret_cast<char*>(&out), sizeof out) && in.gcount() == std::streamsize(sizeof out);
      },
      timeout_seconds);
  if (!found)
    CUPIPE_THROW("NcclCommunicator: the NCCL unique id file '", path.string(), "' did not appear within ",
                 timeout_seconds, " s; is rank 0 running, and is the path on a filesystem every rank sees?");
  return out;
}

/// The exchange through files: a group's id goes through `base`.<name>.<color>.
inline IdExchange file_id_exchange(const std::filesystem::path& base, double timeout) {
  return [base, timeout](const std::string& name, int color, bool root, const ncclUniqueId& made) {
    if (color < 0) return made;
    return share_id_through_file(base.string() + "." + name + "." + std::to_string(color), root, made, timeout);
  };
}

/// What a launcher without MPI gives every rank (NcclCommunicator::from_environment): its rank and
/// the world's size from RANK and WORLD_SIZE, and the world's unique id through the file named by
/// CUPIPE_NCCL_ID_FILE (rank 0 writes it; the others wait up to CUPIPE_NCCL_ID_TIMEOUT seconds,
/// default 300), with the exchange that shares the groups' ids the same way.
struct EnvironmentLaunch {
  int rank = 0, world = 1;
  ncclUniqueId id{};
  IdExchange exchange;
};
inline EnvironmentLaunch environment_launch() {
  EnvironmentLaunch out;
  out.rank = environment_int("RANK");
  out.world = environment_int("WORLD_SIZE");
  const char* file = std::getenv("CUPIPE_NCCL_ID_FILE");
  CUPIPE_REQUIRE(file && *file, "NcclCommunicator::from_environment: set CUPIPE_NCCL_ID_FILE to a path every rank "
                                "can read (rank 0 writes the NCCL unique id there)");
  const char* limit = std::getenv("CUPIPE_NCCL_ID_TIMEOUT");
  const double timeout = limit && *limit ? std::strtod(limit, nullptr) : 300.0;
  const std::filesystem::path base(file);
  out.exchange = file_id_exchange(base, timeout);
  if (out.rank == 0) CUPIPE_COMM_CHECK_NCCL(ncclGetUniqueId(&out.id));
  out.id = share_id_through_file(base, out.rank == 0, out.id, timeout);
  return out;
}

#if defined(CUPIPE_HAS_MPI)
/// The same from an MPI communicator (NcclCommunicator::from_mpi): every rank of `comm` calls it;
/// rank 0 makes the world's unique id and MPI broadcasts it, and the groups' ids go over MPI too.
inline EnvironmentLaunch mpi_launch(MPI_Comm comm) {
  EnvironmentLaunch out;
  CUPIPE_REQUIRE(MPI_Comm_size(comm, &out.world) == MPI_SUCCESS && MPI_Comm_rank(comm, &out.rank) == MPI_SUCCESS,
                 "NcclCommunicator::from_mpi: MPI_Comm_size/rank failed");
  if (out.rank == 0) CUPIPE_COMM_CHECK_NCCL(ncclGetUniqueId(&out.id));
  CUPIPE_REQUIRE(MPI_Bcast(&out.id, int(sizeof out.id), MPI_BYTE, 0, comm) == MPI_SUCCESS,
                 "NcclCommunicator::from_mpi: MPI_Bcast of the NCCL unique id failed");
  out.exchange = mpi_id_exchange(comm, out.rank);
  return out;
}
#endif

/// A communicator of `world`'s ranks with the same `color` (ordered by `key`); a negative color
/// leaves this rank out (it gets null). Collective over the world: every rank makes every split,
/// in the same order. `exchange` is used only where NCCL cannot split communicators.
inline ncclComm_t split_group(ncclComm_t world, const IdExchange& exchange, const std::string& name, int color, int key,
                              int size) {
  ncclComm_t out = nullptr;
#if NCCL_VERSION_CODE >= NCCL_VERSION(2, 18, 0)
  (void)exchange;
  (void)name;
  (void)size;
  CUPIPE_COMM_CHECK_NCCL(ncclCommSplit(world, color < 0 ? NCCL_SPLIT_NOCOLOR : color, key, &out, nullptr));
  return out;
#else
  {
    (void)world;
    CUPIPE_REQUIRE(bool(exchange), "NcclCommunicator: this NCCL (", NCCL_VERSION_CODE, ") cannot split communicators; "
                                   "construct it through from_mpi or from_environment, which exchange group ids");
    // Keys run 0 .. size-1 within a group; key 0 makes the group's id.
    const bool root = color >= 0 && key == 0;
    ncclUniqueId id{};
    if (root) CUPIPE_COMM_CHECK_NCCL(ncclGetUniqueId(&id));
    id = exchange(name, color, root, id);
    if (color < 0) return nullptr;
    CUPIPE_COMM_CHECK_NCCL(ncclCommInitRank(&out, size, id, key));
    return out;
  }
#endif
}

}  // namespace detail

}  // namespace cupipe::comm
