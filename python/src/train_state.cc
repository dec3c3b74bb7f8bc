// python/src/train_state.cc — tiermem.torch's checkpoints and LR schedules, from the same C++ code
// tiermem-train uses (tiermem::train_state: tiermem/checkpoint.h, checkpoint_reshard.h,
// lr_schedule.h):
//   _tiermem.CheckpointWriter / CheckpointReader   one rank's checkpoint: a JSON manifest that
//       lists every tensor with its XXH64, and one state file written to a temporary name, fsynced
//       and renamed (the manifest is the commit point); tensors streamed in parts.
//   _tiermem.OptimizerStateReshard                 a ZeRO optimizer state saved over another
//       number of ranks, re-partitioned as it loads (tiermem/checkpoint_reshard.h): called as
//       the source of ZeroEngine.import_state, it fills this rank's new sub-group from the old
//       ranks' files (verified when it is made), one sub-group at a time.
//   _tiermem.lr_at(config, optimizer_lr, t)        the lr of optimizer step t under the config's
//       `scheduler` section (DeepSpeed's WarmupLR / WarmupDecayLR / WarmupCosineLR).
//
// Thread-safety: a writer or reader is used by one thread. Errors: CheckpointError (a missing or
// corrupt manifest, a checksum mismatch naming the tensor, a short file) -> RuntimeError naming the
// file; IoError -> tiermem.IoError; ConfigError -> ValueError.
#include <algorithm>
#include <memory>
#include <string>
#include <vector>

#include <nanobind/stl/string.h>
#include <nanobind/stl/vector.h>

#include "bindings.h"
#include "tiermem/checkpoint.h"
#include "tiermem/checkpoint_reshard.h"
#include "tiermem/config.h"
#include "tiermem/error.h"
#include "tiermem/lr_schedule.h"

namespace tiermem::py {

namespace {

Tier tier_of(const std::string& s) {
  if (s == "device") return Tier::kDevice;
  if (s == "host") return Tier::kHost;
  if (s == "nvme") return Tier::kNvme;
  throw nb::value_error(("tier must be 'device', 'host' or 'nvme', got '" + s + "'").c_str());
}

std::vector<std::int64_t> shape_of(const std::vector<std::int64_t>& s) { return s; }

class PyWriter {
 public:
  PyWriter(const std::string& dir, int rank, int world, int step)
      : w_(std::make_unique<CheckpointWriter>(dir, rank, world, step)) {}
  int begin_tensor(const std::string& name, const std::string& tier, std::uint64_t bytes,
                   const std::string& dtype, const std::vector<std::int64_t>& shape) {
    return live().begin_tensor(name, tier_of(tier), bytes, dtype, shape_of(shape));
  }
  void write_part(int handle, nb::handle data) {
    ArrayView v = view_array(data, "CheckpointWriter.write_part", "data", false);
    live().write_part(handle, v.data, v.nbytes);
  }
  void add_tensor(const std::string& name, const std::string& tier, nb::handle data, const std::string& dtype,
                  const std::vector<std::int64_t>& shape) {
    ArrayView v = view_array(data, "CheckpointWriter.add_tensor", "data", false);
    live().add_tensor(name, tier_of(tier), v.data, v.nbytes, dtype, shape_of(shape));
  }
  std::string commit(const std::string& meta_json) {
    nlohmann::json meta = nlohmann::json::parse(meta_json);
    std::string path = live().commit(meta);
    w_.reset();
    return path;
  }
  void abandon() { w_.reset(); }  // the temporary state file is removed

 private:
  CheckpointWriter& live() {
    if (!w_) throw nb::value_error("CheckpointWriter: already committed or abandoned");
    return *w_;
  }
  std::unique_ptr<CheckpointWriter> w_;
};

class PyReader {
 public:
  PyReader(const std::string& dir, int rank) : r_(dir, rank) {}
  int step() const { return r_.step(); }
  int world_size() const { return r_.world_size(); }
  std::string meta() const { return r_.meta().dump(); }
  std::string manifest_path() const { return r_.manifest_path(); }
  nb::list tensors() const {
    nb::list out;
    for (const auto& t : r_.tensors()) {
      nb::dict d;
      d["name"] = t.name;
      d["dtype"] = t.dtype;
      d["shape"] = t.shape;
      d["bytes"] = t.bytes;
      d["tier"] = std::string(tier_name(t.tier));
      out.append(d);
    }
    return out;
  }
  void verify_tensor(const std::string& name, std::uint64_t bytes) { r_.verify_tensor(name, bytes); }
  void read_part(const std::string& name, std::uint64_t offset, nb::handle dst) {
    ArrayView v = view_array(dst, "CheckpointReader.read_part", "dst", true);
    r_.read_part(name, offset, v.data, v.nbytes);
  }
  void read_tensor(const std::string& name, nb::handle dst) {
    ArrayView v = view_array(dst, "CheckpointReader.read_tensor", "dst", true);
    r_.read_tensor(name, v.data, v.nbytes);
  }

 private:
  CheckpointReader r_;
};

// ZeroEngine.import_state's source: (offset, master, exp_avg, exp_avg_sq) with three writable
// float32 arrays of the same length.
class PyReshard {
 public:
  PyReshard(const std::string& dir, int old_world, const std::vector<std::string>& names,
            const std::vector<std::size_t>& module_numels, std::size_t alignment_elems, int new_world,
            int new_rank)
      : r_(dir, old_world, names_of(names), module_numels, alignment_elems, new_world, new_rank) {}
  void fill(std::size_t offset, nb::handle master, nb::handle exp_avg, nb::handle exp_avg_sq) {
    const char* what = "OptimizerStateReshard";
    ArrayView a = view_array(master, what, "master", true);
    ArrayView b = view_array(exp_avg, what, "exp_avg", true);
    ArrayView c = view_array(exp_avg_sq, what, "exp_avg_sq", true);
    const nb::dlpack::dtype f32 = nb::dtype<float>();
    if (a.dtype != f32 || b.dtype != f32 || c.dtype != f32 || b.nbytes != a.nbytes || c.nbytes != a.nbytes)
      throw nb::value_error("OptimizerStateReshard: master, exp_avg and exp_avg_sq must be float32 arrays of one "
                            "length");
    r_.fill(offset, a.nbytes / 4, static_cast<float*>(a.data), static_cast<float*>(b.data),
            static_cast<float*>(c.data));
  }
  std::size_t shard_numel() const { return r_.shard_numel(); }
  std::vector<int> source_ranks() const { return r_.source_ranks(); }

 private:
  static OptimizerStateNames names_of(const std::vector<std::string>& n) {
    if (n.size() != 3)
      throw nb::value_error("OptimizerStateReshard: names must be [master, exp_avg, exp_avg_sq] (3 tensor names)");
    return {n[0], n[1], n[2]};
  }
  OptimizerStateReshard r_;
};

}  // namespace

double lr_at_step(const Config& c, double optimizer_lr, long long t) {
  const SchedulerConfig& sc = c.scheduler;
  if (sc.type.empty()) return optimizer_lr;
  if (sc.type != "WarmupLR" && !sc.total_num_steps) {
    throw ConfigError("scheduler.params.total_num_steps", "",
                      "config key 'scheduler.params.total_num_steps' is required for " + sc.type +
                          " (DeepSpeed has no default): give the run's number of optimizer steps");
  }
  // DeepSpeed's defaults for what the section leaves out: WarmupLR/WarmupDecayLR peak at
  // warmup_max_lr = 0.001 over warmup_num_steps = 1000; WarmupCosineLR peaks at the optimizer's lr.
  const double peak = sc.type == "WarmupCosineLR" ? optimizer_lr : 0.001;
  LrSchedule s = make_lr_schedule(sc, peak, 1000, static_cast<int>(sc.total_num_steps.value_or(0)));
  return lr_at_optimizer_step(s, t);  // as DeepSpeed's engine steps the scheduler (lr_schedule.h)
}

void bind_train_state(nb::module_& m) {
  nb::class_<PyWriter>(m, "CheckpointWriter", "One rank's checkpoint being written (tiermem/checkpoint.h).")
      .def(nb::init<const std::string&, int, int, int>(), nb::arg("dir"), nb::arg("rank"), nb::arg("world_size"),
           nb::arg("step"), "Creates DIR/rank<rank>/ (umask applies).")
      .def("begin_tensor", &PyWriter::begin_tensor, nb::arg("name"), nb::arg("tier"), nb::arg("bytes"),
           nb::arg("dtype") = "f32", nb::arg("shape") = std::vector<std::int64_t>{},
           "Reserves a tensor of `bytes` written in parts (write_part, in order); returns its handle.")
      .def("write_part", &PyWriter::write_part, nb::arg("handle"), nb::arg("data"))
      .def("add_tensor", &PyWriter::add_tensor, nb::arg("name"), nb::arg("tier"), nb::arg("data"),
           nb::arg("dtype") = "f32", nb::arg("shape") = std::vector<std::int64_t>{})
      .def("commit", &PyWriter::commit, nb::arg("meta_json"),
           "Writes the manifest (meta: a JSON object), fsyncs, renames; returns the manifest's path.")
      .def("abandon", &PyWriter::abandon, "Drops an uncommitted checkpoint (its temporary file is removed).");
  nb::class_<PyReader>(m, "CheckpointReader", "One rank's checkpoint, manifest validated on opening.")
      .def(nb::init<const std::string&, int>(), nb::arg("dir"), nb::arg("rank"))
      .def_prop_ro("step", &PyReader::step)
      .def_prop_ro("world_size", &PyReader::world_size)
      .def_prop_ro("manifest_path", &PyReader::manifest_path)
      .def("meta", &PyReader::meta, "The manifest's meta object as JSON text.")
      .def("tensors", &PyReader::tensors)
      .def("verify_tensor", &PyReader::verify_tensor, nb::arg("name"), nb::arg("bytes"),
           "Checks size and XXH64 (read in bounded chunks).")
      .def("read_part", &PyReader::read_part, nb::arg("name"), nb::arg("offset"), nb::arg("dst"))
      .def("read_tensor", &PyReader::read_tensor, nb::arg("name"), nb::arg("dst"));
  nb::class_<PyReshard>(m, "OptimizerStateReshard",
                        "A ZeRO optimizer state saved over old_world ranks, re-partitioned for new_world "
                        "(tiermem/checkpoint_reshard.h).")
      .def(nb::init<const std::string&, int, const std::vector<std::string>&, const std::vector<std::size_t>&,
                    std::size_t, int, int>(),
           nb::arg("dir"), nb::arg("old_world"), nb::arg("names"), nb::arg("module_numels"),
           nb::arg("alignment_elems"), nb::arg("new_world"), nb::arg("new_rank"),
           "Opens and verifies (size, XXH64) the old ranks' files this rank reads.")
      .def("__call__", &PyReshard::fill, nb::arg("offset"), nb::arg("master"), nb::arg("exp_avg"),
           nb::arg("exp_avg_sq"), "Fills elements [offset, offset + len) of the new shard; padding is 0.")
      .def_prop_ro("shard_numel", &PyReshard::shard_numel)
      .def("source_ranks", &PyReshard::source_ranks);
  m.def("remove_stale_checkpoint_files", &remove_stale_checkpoint_files, nb::arg("dir"), nb::arg("rank"));
}

}  // namespace tiermem::py
