// A decode step's decoder layers in one call from Python (specdec/models/fused.py).
//
// A single-token decode of the default model makes about 240 calls into the kernels, eight a
// layer, and between them Python: module lookups, views, splits, wrappers that pick a kernel.
// With w4a8 weights the linears stream their 98 MB in about 2.9 ms; the step took 5.3 ms, and
// 3.7 ms once that glue was gone. DecoderStack runs the same ops, in the same order, on the same
// kernels, with the same arguments as models/llama.py's DecoderLayer.forward does for a step of
// decodes and verifications (one group of queries, padded or not: see specdec/attention.py), so
// every row gets the bits the Python path gives it; the tests compare the two bit for bit.
// Prompt chunks, which the Python path splits into groups and sends through SDPA, stay in Python.
//
// LoRA adapters (specdec/models/lora.py) add their deltas the way LoRALinear.forward does: after
// a linear, each adapter of the step, in the step's order, adds up(down(x)) to its rows (to
// every row with `y += d`, else gathered and added back with index_add_), on the same kernels.

#include <pybind11/stl.h>
#include <torch/extension.h>

#include "cpu_simd.h"

#include <map>
#include <optional>
#include <utility>
#include <vector>

// The kernels it calls are declared in cpu_simd.h.

namespace {

using OptionalTensor = c10::optional<torch::Tensor>;

// A linear layer as one of the three kernels takes it (models/fused.py reads it off the module).
struct StackLinear {
  enum Kind : int64_t { kLanes = 0, kPairs = 1, kQuant = 2 };
  int64_t kind;
  torch::Tensor weight;  // the float32 weight packed in lanes, the bf16 packed in pairs, or the codes
  OptionalTensor scales, extra, bias;
  int64_t bits, out;
  bool int8_activations;

  StackLinear(int64_t kind, torch::Tensor weight, OptionalTensor scales, OptionalTensor extra,
              OptionalTensor bias, int64_t bits, int64_t out, bool int8_activations)
      : kind(kind), weight(std::move(weight)), scales(std::move(scales)),
        extra(std::move(extra)), bias(std::move(bias)), bits(bits), out(out),
        int8_activations(int8_activations) {
    TORCH_CHECK(kind >= kLanes && kind <= kQuant, "unknown linear kind ", kind);
    TORCH_CHECK(kind != kQuant || this->scales.has_value(), "a quantized linear needs scales");
  }

  torch::Tensor operator()(const torch::Tensor& x) const {
    switch (kind) {
      case kLanes: return ::linear_lanes(x, weight, bias, out);
      case kPairs: return ::linear_pairs(x, weight, bias, out);
      default: return ::quant_linear(x, weight, *scales, extra, bias, bits, out, int8_activations);
    }
  }
};

// One adapter's delta on one linear: up(down(x)), the scale folded into up.
struct StackDelta {
  StackLinear down, up;

  StackDelta(StackLinear down, StackLinear up) : down(std::move(down)), up(std::move(up)) {}

  // y += the delta of x's rows `rows` (every row where it holds no tensor), as LoRALinear does.
  void add_to(torch::Tensor& y, const torch::Tensor& x, const OptionalTensor& rows) const {
    if (!rows.has_value()) {
      y.add_(up(down(x.contiguous())));
    } else {
      y.index_add_(0, *rows, up(down(x.index_select(0, *rows).contiguous())));
    }
  }
};

// One adapter's deltas on one layer's four linears (none where it leaves a linear alone).
struct AdapterLayer {
  std::optional<StackDelta> qkv, o, gate_up, down;

  AdapterLayer(std::optional<StackDelta> qkv, std::optional<StackDelta> o,
               std::optional<StackDelta> gate_up, std::optional<StackDelta> down)
      : qkv(std::move(qkv)), o(std::move(o)), gate_up(std::move(gate_up)), down(std::move(down)) {}
};

using Adapters = std::map<int64_t, std::vector<AdapterLayer>>;  // adapter key -> its layers

struct StackLayer {
  torch::Tensor input_norm, post_norm;  // RMSNorm weights
  StackLinear qkv, o, gate_up, down;
  torch::Tensor k_cache, v_cache;  // [blocks, block_size, kv_heads, head_dim]
  OptionalTensor q_norm, k_norm;  // Qwen3's per-head query and key RMSNorm weights [head_dim]

  StackLayer(torch::Tensor input_norm, torch::Tensor post_norm, StackLinear qkv, StackLinear o,
             StackLinear gate_up, StackLinear down, torch::Tensor k_cache, torch::Tensor v_cache,
             OptionalTensor q_norm, OptionalTensor k_norm)
      : input_norm(std::move(input_norm)), post_norm(std::move(post_norm)), qkv(std::move(qkv)),
        o(std::move(o)), gate_up(std::move(gate_up)), down(std::move(down)),
        k_cache(std::move(k_cache)), v_cache(std::move(v_cache)), q_norm(std::move(q_norm)),
        k_norm(std::move(k_norm)) {
    TORCH_CHECK(this->q_norm.has_value() == this->k_norm.has_value(),
                "give both query and key norms, or neither");
  }
};

class DecoderStack {
 public:
  DecoderStack(std::vector<StackLayer> layers, torch::Tensor final_norm, int64_t heads,
               int64_t kv_heads, int64_t head_dim, double scale, double eps, Adapters adapters)
      : layers_(std::move(layers)), final_norm_(std::move(final_norm)), heads_(heads),
        kv_heads_(kv_heads), head_dim_(head_dim), scale_(scale), eps_(eps),
        adapters_(std::move(adapters)) {
    for (const auto& [key, adapter_layers] : adapters_)
      TORCH_CHECK(adapter_layers.size() == layers_.size(), "adapter ", key, " has ",
                  adapter_layers.size(), " layers, the stack ", layers_.size());
  }

  // The final hidden states [N, hidden] of N query tokens whose embeddings are `x` (a fresh
  // tensor: it becomes the residual stream, updated in place), as LlamaForCausalLM.forward.
  // `lora_keys[a]` is an adapter of the step and `lora_rows[a]` its rows (none: every row).
  torch::Tensor forward(torch::Tensor x, const torch::Tensor& cos, const torch::Tensor& sin,
                        const torch::Tensor& slots, const torch::Tensor& query_index,
                        const torch::Tensor& key_slots, const torch::Tensor& query_lens,
                        const torch::Tensor& context_lens, const torch::Tensor& valid_index,
                        const torch::Tensor& valid_rows, bool dense,
                        const std::vector<int64_t>& lora_keys,
                        const std::vector<OptionalTensor>& lora_rows) {
    TORCH_CHECK(lora_keys.size() == lora_rows.size(), "one row set per adapter");
    std::vector<const std::vector<AdapterLayer>*> step_adapters;
    for (const int64_t key : lora_keys) {
      const auto found = adapters_.find(key);
      TORCH_CHECK(found != adapters_.end(), "adapter ", key, " is not in the stack");
      step_adapters.push_back(&found->second);
    }
    // y += every adapter's delta of input x on `part` of layer i
    const auto deltas = [&](torch::Tensor& y, const torch::Tensor& x, size_t i,
                            std::optional<StackDelta> AdapterLayer::*part) {
      for (size_t a = 0; a < step_adapters.size(); a++) {
        const std::optional<StackDelta>& delta = (*step_adapters[a])[i].*part;
        if (delta.has_value()) delta->add_to(y, x, lora_rows[a]);
      }
    };
    const int64_t n = x.size(0);
    torch::Tensor residual;
    for (size_t i = 0; i < layers_.size(); i++) {
      StackLayer& l = layers_[i];
      torch::Tensor h;
      if (i == 0) {
        residual = x;
        h = ::rms_norm(x, l.input_norm, eps_);
      } else {
        h = add_rms_norm_(residual, x, l.input_norm, eps_);
      }
      torch::Tensor qkv = l.qkv(h);
      deltas(qkv, h, i, &AdapterLayer::qkv);
      if (l.q_norm.has_value()) norm_heads(qkv, n, *l.q_norm, *l.k_norm);
      rope_(qkv, cos, sin, heads_ + kv_heads_, head_dim_);
      const auto parts =
          qkv.view({n, -1, head_dim_}).split_with_sizes({heads_, kv_heads_, kv_heads_}, 1);
      write_kv_(parts[1], parts[2], l.k_cache, l.v_cache, slots);
      torch::Tensor attention = cached_attention(parts[0], l.k_cache, l.v_cache, query_index,
                                                 key_slots, query_lens, context_lens, scale_);
      if (!dense) {  // padded queries: each real row to its token's place
        const torch::Tensor rows = attention.flatten(0, 1).index_select(0, valid_rows);
        attention = torch::empty_like(parts[0]).index_copy_(0, valid_index, rows);
      }
      const torch::Tensor flat = attention.reshape({n, heads_ * head_dim_});
      torch::Tensor o = l.o(flat);
      deltas(o, flat, i, &AdapterLayer::o);
      h = add_rms_norm_(residual, o, l.post_norm, eps_);
      torch::Tensor gate_up = l.gate_up(h);
      deltas(gate_up, h, i, &AdapterLayer::gate_up);
      const torch::Tensor activated = silu_mul(gate_up);
      x = l.down(activated);
      deltas(x, activated, i, &AdapterLayer::down);
    }
    return add_rms_norm_(residual, x, final_norm_, eps_);
  }

 private:
  // Qwen3's query and key norms in place, as Attention._norm_heads: every head's head_dim
  // values of each row RMS-normed (gathered, normed, written back).
  void norm_heads(torch::Tensor& qkv, int64_t n, const torch::Tensor& q_norm,
                  const torch::Tensor& k_norm) const {
    const int64_t q_end = heads_ * head_dim_, k_end = q_end + kv_heads_ * head_dim_;
    const torch::Tensor q = qkv.slice(1, 0, q_end).reshape({n * heads_, head_dim_});
    const torch::Tensor k = qkv.slice(1, q_end, k_end).reshape({n * kv_heads_, head_dim_});
    qkv.slice(1, 0, q_end).copy_(::rms_norm(q, q_norm, eps_).view({n, q_end}));
    qkv.slice(1, q_end, k_end).copy_(::rms_norm(k, k_norm, eps_).view({n, k_end - q_end}));
  }

  std::vector<StackLayer> layers_;
  torch::Tensor final_norm_;
  int64_t heads_, kv_heads_, head_dim_;
  double scale_, eps_;
  Adapters adapters_;
};

}  // namespace

void register_decoder_stack(pybind11::module& m) {
  namespace py = pybind11;
  py::class_<StackLinear>(m, "StackLinear")
      .def(py::init<int64_t, torch::Tensor, OptionalTensor, OptionalTensor, OptionalTensor, int64_t,
                    int64_t, bool>());
  py::class_<StackDelta>(m, "StackDelta").def(py::init<StackLinear, StackLinear>());
  py::class_<AdapterLayer>(m, "AdapterLayer")
      .def(py::init<std::optional<StackDelta>, std::optional<StackDelta>,
                    std::optional<StackDelta>, std::optional<StackDelta>>());
  py::class_<StackLayer>(m, "StackLayer")
      .def(py::init<torch::Tensor, torch::Tensor, StackLinear, StackLinear, StackLinear,
                    StackLinear, torch::Tensor, torch::Tensor, OptionalTensor, OptionalTensor>());
  py::class_<DecoderStack>(m, "DecoderStack")
      .def(py::init<std::vector<StackLayer>, torch::Tensor, int64_t, int64_t, int64_t, double,
                    double, Adapters>())
      .def("forward", &DecoderStack::forward, "a step of decodes and verifications, every layer");
}
