// A Llama-family decoder stack in one call: the same ops, in the same order, as model/llama.py's layers run
// them from Python, so the result is bit-identical; only the interpreter leaves the loop. At decode batch
// sizes a layer is ~10 op calls of a few microseconds of work each, and Python around them (module calls,
// dtype and layout checks, splits, views) cost ~6 ms of a ~17 ms step of the embedded 30-layer model on one
// stream. Each op is still called through the dispatcher (its own checks included); the handles are looked up
// once.
//   decoder_layers(x, positions, kv_caches, <attention metadata>, scale, cos_sin, norms, weights, qtypes, parts,
//                  biases, gemm_ids, heads, eps, batch_invariant, residual, interrupt, layers_run) -> (x, residual)
// Per layer i: norms[2i], norms[2i+1] (input / post-attention RMSNorm weights); linears 4i..4i+3 (qkv, o,
// gate_up, down), linear j made of parts[j] row segments of GGUF blocks of one type each (a Q4_K_M qkv_proj:
// Q4_K and Q6_K), listed in order in weights and their types in qtypes; biases[j] (None for none); gemm_ids[j]
// the kernel of linear j: 0 gemm_gguf, 1 gemm_gguf_amx, 2 gemm_gguf_int8, 3 gemm_gguf_bf16 (model/layers/gguf_quant.py's
// kernel_choice picks, as it does per call from Python: GEMM_IDS); heads = [num_heads, num_kv_heads,
// head_dim]; batch_invariant: attention and gemm_gguf_int8 in their batch-invariant forms (both ops' flag; the
// caller picks gemm_gguf or gemm_gguf_int8 in gemm_ids, both row-independent then). x: the embeddings [tokens, hidden];
// returns the last layer's output and the residual stream (the hidden state is their sum, pre-final-norm).
// A run of layers from the middle of the stack (the lists hold only its layers) continues from the (x, residual)
// the run before it returned: given a residual, the first layer adds x to it as every later layer does, so runs
// over consecutive layers give what one call over all of them does, bit for bit. interrupt (int64 [1], another
// thread may set it while the call runs): when it is non-zero before a layer other than the first, the call
// returns there, having run layers_run[0] (int64 [1]) of its layers; the caller continues with a run from there.
#include <ATen/core/Tensor.h>
#include <ATen/core/dispatch/Dispatcher.h>
#include <ATen/ops/cat.h>

#include <optional>
#include <string>
#include <tuple>
#include <vector>

#include "ops_library.h"

namespace {

#define PAGEDSERVE_STR_EXPAND(x) #x
#define PAGEDSERVE_STR(x) PAGEDSERVE_STR_EXPAND(x)

using Tensor = at::Tensor;
using OptTensor = std::optional<Tensor>;

template <class Sig>
using Op = c10::TypedOperatorHandle<Sig>;

template <class Sig>
Op<Sig> handle(const char* name) {
  const std::string full = std::string(PAGEDSERVE_STR(PAGEDSERVE_OPS_NS)) + "::" + name;
  return c10::Dispatcher::singleton().findSchemaOrThrow(full.c_str(), "").typed<Sig>();
}

// The in-place ops take their mutated tensors by value, as registered (a handle's type must match exactly).
using NormSig = Tensor(const Tensor&, const Tensor&, double);
using AddNormSig = void(Tensor, Tensor, const Tensor&, double);
using RotarySig = void(Tensor, Tensor, const Tensor&, const Tensor&);
using ActSig = Tensor(const Tensor&);
using AttentionSig = Tensor(const Tensor&, const Tensor&, const Tensor&, Tensor, const Tensor&, const Tensor&,
                            const Tensor&, const Tensor&, double, int64_t, int64_t, double, bool);
using GemmSig = Tensor(const Tensor&, const Tensor&, int64_t, const OptTensor&);
using AmxSig = Tensor(const Tensor&, const Tensor&, int64_t, const OptTensor&, std::optional<at::ScalarType>);
using Int8Sig = Tensor(const Tensor&, const Tensor&, int64_t, const OptTensor&, std::optional<bool>, bool);

struct Ops {
  Op<NormSig> rms_norm = handle<NormSig>("rms_norm");
  Op<AddNormSig> add_rms_norm = handle<AddNormSig>("fused_add_rms_norm_");
  Op<RotarySig> rotary = handle<RotarySig>("rotary_embedding_");
  Op<ActSig> silu_and_mul = handle<ActSig>("silu_and_mul");
  Op<AttentionSig> attention = handle<AttentionSig>("paged_attention_windowed");
  Op<GemmSig> gemm = handle<GemmSig>("gemm_gguf");
  Op<Int8Sig> int8_gemm = handle<Int8Sig>("gemm_gguf_int8");
  Op<GemmSig> bf16_gemm = handle<GemmSig>("gemm_gguf_bf16");
};

const Ops& ops() {
  static const Ops o;
  return o;
}

// Only the amx build registers gemm_gguf_amx: looked up on first use.
const Op<AmxSig>& amx_gemm() {
  static const auto h = handle<AmxSig>("gemm_gguf_amx");
  return h;
}

std::tuple<Tensor, Tensor> decoder_layers(const Tensor& embeddings, const Tensor& positions,
                                          const std::vector<Tensor>& kv_caches, const Tensor& slot_mapping,
                                          const Tensor& block_tables, const Tensor& seq_lens,
                                          const Tensor& query_start_loc, double scale, const Tensor& cos_sin,
                                          const std::vector<Tensor>& norms, const std::vector<Tensor>& weights,
                                          c10::IntArrayRef qtypes, c10::IntArrayRef parts,
                                          const std::vector<OptTensor>& biases,
                                          c10::IntArrayRef gemm_ids, c10::IntArrayRef heads, double eps,
                                          bool batch_invariant, const OptTensor& residual_in,
                                          const OptTensor& interrupt, const OptTensor& layers_run) {
  constexpr const char* op = "decoder_layers";
  const auto layers = static_cast<int64_t>(kv_caches.size());
  TORCH_CHECK(layers > 0, op, ": no layers");
  TORCH_CHECK(norms.size() == 2 * kv_caches.size(), op, ": ", norms.size(), " norm weights for ", layers, " layers");
  const size_t n_linears = 4 * kv_caches.size();
  TORCH_CHECK(parts.size() == n_linears && biases.size() == n_linears && gemm_ids.size() == n_linears, op,
              ": parts, biases and gemm_ids need 4 entries per layer (", n_linears, "), got ", parts.size(), ", ",
              biases.size(), ", ", gemm_ids.size());
  for (size_t j = 0; j < n_linears; ++j)
    TORCH_CHECK(gemm_ids[j] >= 0 && gemm_ids[j] <= 3, op, ": gemm_ids[", j, "] is ", gemm_ids[j],
                "; 0 gemm_gguf, 1 gemm_gguf_amx, 2 gemm_gguf_int8, 3 gemm_gguf_bf16");
  std::vector<size_t> first(n_linears + 1, 0);  // linear j's parts: weights[first[j] .. first[j + 1] - 1]
  for (size_t j = 0; j < n_linears; ++j) {
    TORCH_CHECK(parts[j] > 0, op, ": linear ", j, " has ", parts[j], " parts");
    first[j + 1] = first[j] + parts[j];
  }
  TORCH_CHECK(weights.size() == first.back() && qtypes.size() == first.back(), op, ": the parts need ",
              first.back(), " weights and qtypes, got ", weights.size(), " and ", qtypes.size());
  TORCH_CHECK(heads.size() == 3 && heads[0] > 0 && heads[1] > 0 && heads[2] > 0, op,
              ": heads must be [num_heads, num_kv_heads, head_dim], got ", heads);
  TORCH_CHECK(embeddings.dim() == 2, op, ": x must be [tokens, hidden], got shape ", embeddings.sizes());
  const Ops& o = ops();
  const int64_t tokens = embeddings.size(0), q_size = heads[0] * heads[2], kv_size = heads[1] * heads[2];
  auto gemm = [&](const Tensor& x, size_t j, size_t part, const OptTensor& bias) {
    switch (gemm_ids[j]) {
      case 1: return amx_gemm().call(x, weights[part], qtypes[part], bias, std::nullopt);
      case 2: return o.int8_gemm.call(x, weights[part], qtypes[part], bias, std::nullopt, batch_invariant);
      case 3: return o.bf16_gemm.call(x, weights[part], qtypes[part], bias);
      default: return o.gemm.call(x, weights[part], qtypes[part], bias);
    }
  };
  auto linear = [&](const Tensor& x, size_t j) {
    if (parts[j] == 1) return gemm(x, j, first[j], biases[j]);
    // the parts side by side, then the bias: as gguf_quant.py's _by_parts
    std::vector<Tensor> ys;
    for (size_t p = first[j]; p < first[j + 1]; ++p) ys.push_back(gemm(x, j, p, std::nullopt));
    Tensor y = at::cat(ys, 1);
    if (biases[j].has_value() && biases[j]->defined()) y.add_(*biases[j]);
    return y;
  };
  const bool continues = residual_in.has_value() && residual_in->defined();
  if (continues)
    TORCH_CHECK(residual_in->sizes() == embeddings.sizes(), op, ": residual has shape ", residual_in->sizes(),
                ", x ", embeddings.sizes());
  Tensor x = embeddings, residual = continues ? *residual_in : Tensor();
  const volatile int64_t* stop = nullptr;  // read at every layer: written by another thread
  int64_t* run = nullptr;
  if (interrupt.has_value() && interrupt->defined()) {
    for (const Tensor* t : {&*interrupt, layers_run.has_value() ? &*layers_run : nullptr})
      TORCH_CHECK(t != nullptr && t->defined() && t->scalar_type() == at::kLong && t->numel() >= 1 &&
                      t->device().is_cpu(), op, ": interrupt and layers_run must be int64 CPU tensors of >= 1 element");
    stop = interrupt->data_ptr<int64_t>();
    run = layers_run->data_ptr<int64_t>();
  }
  for (int64_t i = 0; i < layers; ++i) {
    if (i > 0 && stop != nullptr && *stop != 0) {
      *run = i;
      return {x, residual};
    }
    if (i == 0 && !continues) {
      residual = x;
      x = o.rms_norm.call(x, norms[0], eps);
    } else {
      o.add_rms_norm.call(x, residual, norms[2 * i], eps);
    }
    const Tensor qkv = linear(x, 4 * i);
    TORCH_CHECK(qkv.size(1) == q_size + 2 * kv_size, op, ": layer ", i, "'s qkv weight has ", qkv.size(1),
                " rows, the heads need ", q_size + 2 * kv_size);
    const Tensor q = qkv.narrow(1, 0, q_size).view({tokens, heads[0], heads[2]});
    const Tensor k = qkv.narrow(1, q_size, kv_size).view({tokens, heads[1], heads[2]});
    const Tensor v = qkv.narrow(1, q_size + kv_size, kv_size).view({tokens, heads[1], heads[2]});
    o.rotary.call(q, k, positions, cos_sin);
    const Tensor attn = o.attention.call(q, k, v, kv_caches[i], slot_mapping, block_tables, seq_lens,
                                         query_start_loc, scale, -1, 0, 0.0, batch_invariant);
    x = linear(attn.reshape({tokens, q_size}), 4 * i + 1);
    o.add_rms_norm.call(x, residual, norms[2 * i + 1], eps);
    x = linear(o.silu_and_mul.call(linear(x, 4 * i + 2)), 4 * i + 3);
  }
  if (run != nullptr) *run = layers;
  return {x, residual};
}

}  // namespace

PAGEDSERVE_LIBRARY_FRAGMENT(m) {
  m.def("decoder_layers(Tensor x, Tensor positions, Tensor(a!)[] kv_caches, Tensor slot_mapping, "
        "Tensor block_tables, Tensor seq_lens, Tensor query_start_loc, float scale, Tensor cos_sin, Tensor[] norms, "
        "Tensor[] weights, int[] qtypes, int[] parts, Tensor?[] biases, int[] gemm_ids, int[] heads, float eps, "
        "bool batch_invariant=False, Tensor(b!)? residual=None, Tensor? interrupt=None, Tensor(c!)? layers_run=None) "
        "-> (Tensor, Tensor)");
  m.impl("decoder_layers", c10::DispatchKey::CPU, decoder_layers);
}
