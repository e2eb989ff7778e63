// poss::decoder_layer, poss::specialist_forward and poss::eagle3_layer_forward, written once on
// one layer body and registered once as CompositeExplicitAutograd: the per-device work happens in
// the ops they dispatch to.
#include "poss/decoder_layer.h"

#include <ATen/core/dispatch/Dispatcher.h>
#include <torch/library.h>

#include <cmath>
#include <limits>
#include <string>
#include <vector>

#include "poss/arg_checks.h"
#include "poss/layer_args.h"
#include "poss/qlinear_args.h"
#include "poss/tree_attention_args.h"

namespace poss {
namespace {

template <typename Sig>
c10::TypedOperatorHandle<Sig> op(const char* name) {
  return c10::Dispatcher::singleton().findSchemaOrThrow(name, "").typed<Sig>();
}

at::Tensor call_rms_norm(const at::Tensor& x, const at::Tensor& w, double eps) {
  static auto h = op<at::Tensor(const at::Tensor&, const at::Tensor&, double)>("poss::rms_norm");
  return h.call(x, w, eps);
}

std::tuple<at::Tensor, at::Tensor> call_add_rms_norm(const at::Tensor& x, const at::Tensor& r,
                                                     const at::Tensor& w, double eps) {
  static auto h = op<std::tuple<at::Tensor, at::Tensor>(const at::Tensor&, const at::Tensor&,
                                                        const at::Tensor&, double)>("poss::add_rms_norm");
  return h.call(x, r, w, eps);
}

at::Tensor call_swiglu(const at::Tensor& x) {
  static auto h = op<at::Tensor(const at::Tensor&)>("poss::swiglu");
  return h.call(x);
}

at::Tensor call_rope_qkv(const at::Tensor& qkv, const at::Tensor& pos, const at::Tensor& inv_freq,
                         at::Tensor& k, at::Tensor& v, const at::Tensor& start, int64_t hq, int64_t hkv) {
  static auto h = op<at::Tensor(const at::Tensor&, const at::Tensor&, const at::Tensor&, at::Tensor&,
                                at::Tensor&, const at::Tensor&, int64_t, int64_t)>("poss::rope_qkv");
  return h.call(qkv, pos, inv_freq, k, v, start, hq, hkv);
}

at::Tensor call_tree_attention(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                               const at::Tensor& prefix_len, const at::Tensor& parents, double scale) {
  static auto h = op<at::Tensor(const at::Tensor&, const at::Tensor&, const at::Tensor&,
                                const at::Tensor&, const at::Tensor&, double)>("poss::tree_attention");
  return h.call(q, k, v, prefix_len, parents, scale);
}

// y = x @ w^T (+ bias) (+ residual), through poss::linear: with its CPU kernels (bf16 on
// AVX512-BF16, fp32 on AVX2 + FMA) a row's result does not depend on how many rows (tree nodes)
// share the call.
at::Tensor call_linear(const at::Tensor& x, const at::Tensor& w, const std::optional<at::Tensor>& bias,
                       const std::optional<at::Tensor>& residual) {
  static auto h = op<at::Tensor(const at::Tensor&, const at::Tensor&, const std::optional<at::Tensor>&,
                                const std::optional<at::Tensor>&)>("poss::linear");
  return h.call(x, w, bias, residual);
}

// The same through poss::qlinear when `format` names GGUF blocks (LayerWeights::formats).
at::Tensor call_project(const at::Tensor& x, const at::Tensor& w, const std::string& format, bool x_int8,
                        const std::optional<at::Tensor>& bias, const std::optional<at::Tensor>& residual) {
  if (format.empty()) return call_linear(x, w, bias, residual);
  static auto h = op<at::Tensor(const at::Tensor&, const at::Tensor&, c10::string_view,
                                const std::optional<at::Tensor>&, const std::optional<at::Tensor>&, bool)>(
      "poss::qlinear");
  return h.call(x, w, format, bias, residual, x_int8);
}

void check_weight(const at::Tensor& t, const char* name, int64_t rows, int64_t cols,
                  const at::Tensor& x) {
  check_dim(t, name, 2, "[out, in]");
  check_size(t, name, 0, rows, "the expected output features");
  check_size(t, name, 1, cols, "the expected input features");
  check_dtype(t, name, x.scalar_type());
  check_same_device(t, name, x, "x");
}

// check_weight, or for GGUF blocks in `format` (non-empty): [rows, cols / 32 * B] uint8.
void check_weight(const at::Tensor& t, const char* name, int64_t rows, int64_t cols, const at::Tensor& x,
                  const std::string& format) {
  if (format.empty()) return check_weight(t, name, rows, cols, x);
  const QLayout layout = parse_qformat(format);
  TORCH_CHECK(cols % kQBlock == 0, name, ": blocks need the input features (", cols, ") to be a multiple of 32");
  check_dim(t, name, 2, "[out, in / 32 * block bytes] uint8");
  check_size(t, name, 0, rows, "the expected output features");
  check_size(t, name, 1, cols / kQBlock * qblock_bytes(layout.format), "the input features / 32 * block bytes");
  check_dtype(t, name, at::kByte);
  check_same_device(t, name, x, "x");
}

void check_vector(const at::Tensor& t, const char* name, int64_t n, const at::Tensor& x) {
  check_dim(t, name, 1, "[n]");
  check_size(t, name, 0, n, "the expected size");
  check_dtype(t, name, x.scalar_type());
  check_same_device(t, name, x, "x");
}

// Everything the layer's ops would check, checked before rope_qkv writes the cache, with this
// op's argument names: a later op's error would leave the cache written and name its own
// arguments (q, start). x is the residual stream [B, T, H]; the QKV projection reads qkv_in
// features per token (H, or 2H for an EAGLE-3 layer's [embedding; hidden]).
void check_layer(const at::Tensor& x, const LayerWeights& w, const LayerInputs& in, int64_t qkv_in) {
  check_float_dtype(x, "x");
  check_dim(x, "x", 3, "[B, T, H]");
  check_dim(in.k_cache, "k_cache", 4, "[B, Hkv, S, D]");
  TORCH_CHECK(in.num_heads > 0 && in.num_kv_heads > 0 && in.num_heads % in.num_kv_heads == 0,
              "num_heads must be a positive multiple of num_kv_heads, got ", in.num_heads, " and ",
              in.num_kv_heads);
  const int64_t B = x.size(0), T = x.size(1), H = x.size(2), S = in.k_cache.size(2),
                D = in.k_cache.size(3);
  TORCH_CHECK(supported_head_dim(D), "k_cache.size(3) (head dim D) must be one of ", head_dims_text(),
              ", got shape ", shape_str(in.k_cache));
  check_dtype(in.k_cache, "k_cache", x.scalar_type());
  check_size(in.k_cache, "k_cache", 0, B, "B");
  check_size(in.k_cache, "k_cache", 1, in.num_kv_heads, "num_kv_heads");
  check_same_device(in.k_cache, "k_cache", x, "x");
  TORCH_CHECK(in.v_cache.sizes() == in.k_cache.sizes(), "v_cache must have k_cache's shape ",
              shape_str(in.k_cache), ", got ", shape_str(in.v_cache));
  check_dtype(in.v_cache, "v_cache", x.scalar_type());
  check_same_device(in.v_cache, "v_cache", x, "x");
  const int64_t qkv = (in.num_heads + 2 * in.num_kv_heads) * D;
  TORCH_CHECK(w.w_gate_up.dim() == 2 && w.w_gate_up.size(0) % 2 == 0,
              "w_gate_up must be [2F, H] (gate rows then up rows), got shape ", shape_str(w.w_gate_up));
  const int64_t F = w.w_gate_up.size(0) / 2;
  if (w.in_norm_w) check_vector(*w.in_norm_w, "in_norm_w", H, x);
  check_weight(w.w_qkv, "w_qkv", qkv, qkv_in, x, w.formats[0]);
  if (w.b_qkv) check_vector(*w.b_qkv, "b_qkv", qkv, x);
  check_weight(w.w_o, "w_o", H, in.num_heads * D, x, w.formats[1]);
  check_vector(w.post_norm_w, "post_norm_w", H, x);
  check_weight(w.w_gate_up, "w_gate_up", 2 * F, H, x, w.formats[2]);
  check_weight(w.w_down, "w_down", H, F, x, w.formats[3]);
  check_dtype(in.prefix_len, "prefix_len", at::kInt);
  check_dim(in.prefix_len, "prefix_len", 1, "[B]");
  check_size(in.prefix_len, "prefix_len", 0, B, "B");
  check_same_device(in.prefix_len, "prefix_len", x, "x");
  check_dtype(in.parents, "parents", at::kInt);
  check_dim(in.parents, "parents", 2, "[B, N]");
  check_size(in.parents, "parents", 0, B, "B");
  check_same_device(in.parents, "parents", x, "x");
  const int64_t N = in.parents.size(1);
  TORCH_CHECK(N >= 1 && N >= T, "parents must hold at least one node (the root) and T = ", T,
              " nodes (the new tokens are its last T nodes), got shape ", shape_str(in.parents));
  TORCH_CHECK(N <= S, "k_cache.size(2) (S) must be >= N = parents.size(1) = ", N, ", got shape ",
              shape_str(in.k_cache));
  check_dtype(in.positions, "positions", at::kLong);
  check_dim(in.positions, "positions", 2, "[B, T]");
  check_size(in.positions, "positions", 0, B, "B");
  check_size(in.positions, "positions", 1, T, "T");
  check_same_device(in.positions, "positions", x, "x");
  check_dtype(in.inv_freq, "inv_freq", at::kFloat);
  check_dim(in.inv_freq, "inv_freq", 1, "[D / 2]");
  check_size(in.inv_freq, "inv_freq", 0, D / 2, "D / 2");
  check_same_device(in.inv_freq, "inv_freq", x, "x");
#ifdef POSS_WITH_CUDA
  // The CUDA kernels of rope_qkv and tree_attention check the values with device asserts: no host
  // sync per layer.
  if (x.is_cuda()) return;
#endif
  // CPU tensors, or CUDA ones served by the Python references (which read them on the host anyway).
  const auto prefix_len = in.prefix_len.cpu().contiguous();
  const auto parents = in.parents.cpu().contiguous();
  const int32_t* pl = prefix_len.data_ptr<int32_t>();
  const int32_t* par = parents.data_ptr<int32_t>();
  for (int64_t b = 0; b < B; ++b) {
    check_attention_tree(par + b * N, N, b);
    // int64: prefix_len + N overflows int32 near INT32_MAX.
    const int64_t end = int64_t{pl[b]} + N;
    TORCH_CHECK(pl[b] >= 0 && end <= S, "prefix_len[", b, "] = ", pl[b],
                " must be >= 0 and leave room for the tree's N = ", N,
                " nodes in k_cache (prefix_len + N <= S = ", S,
                "); the new tokens' K/V start at slot prefix_len + N - T");
    TORCH_CHECK(end - T <= std::numeric_limits<int32_t>::max(), "prefix_len[", b, "] + N - T = ",
                end - T, " (the slot the new tokens' K/V start at) must fit in int32");
  }
}

}  // namespace

namespace {

// The layer after its input norm: a [B*T, qkv_in] feeds QKV; x2 [B*T, H] is the residual.
at::Tensor layer_body(const at::Tensor& x2, const at::Tensor& a, int64_t B, int64_t T, const LayerWeights& w,
                      LayerInputs& in) {
  const int64_t H = x2.size(1), D = in.k_cache.size(3), N = in.parents.size(1);
  const auto qkv = call_project(a, w.w_qkv, w.formats[0], w.x_int8, w.b_qkv, std::nullopt).view({B, T, -1});
  // The new tokens are the tree's last T nodes; node i's K/V lives at slot prefix_len + i. (A
  // target forward's T is N: no add, which costs ~10 us a layer on a CPU.)
  const auto start = N == T ? in.prefix_len : in.prefix_len + static_cast<int32_t>(N - T);
  const auto q = call_rope_qkv(qkv, in.positions, in.inv_freq, in.k_cache, in.v_cache, start,
                               in.num_heads, in.num_kv_heads);
  const auto attn = call_tree_attention(q, in.k_cache, in.v_cache, in.prefix_len, in.parents,
                                        1.0 / std::sqrt(static_cast<double>(D)));
  const auto attn2 = attn.transpose(1, 2).reshape({B * T, in.num_heads * D});
  auto [m_in, h] = call_add_rms_norm(call_project(attn2, w.w_o, w.formats[1], w.x_int8, std::nullopt, std::nullopt),
                                     x2, w.post_norm_w, in.eps);
  const auto act =
      call_swiglu(call_project(m_in, w.w_gate_up, w.formats[2], w.x_int8, std::nullopt, std::nullopt));
  return call_project(act, w.w_down, w.formats[3], w.x_int8, std::nullopt, h).view({B, T, H});
}

}  // namespace

at::Tensor decoder_layer_forward(const at::Tensor& x, const LayerWeights& w, LayerInputs& in) {
  check_layer(x, w, in, x.dim() == 3 ? x.size(2) : 0);
  const int64_t B = x.size(0), T = x.size(1), H = x.size(2);
  // No new tokens: nothing to write to the cache (and view({B, T, -1}) below would be ambiguous).
  if (B * T == 0) return at::empty({B, T, H}, x.options());
  const auto x2 = x.reshape({B * T, H});
  const auto a = w.in_norm_w ? call_rms_norm(x2, *w.in_norm_w, in.eps) : x2;
  return layer_body(x2, a, B, T, w, in);
}

namespace {

at::Tensor decoder_layer_op(const at::Tensor& x, const std::optional<at::Tensor>& in_norm_w,
                            const at::Tensor& w_qkv, const std::optional<at::Tensor>& b_qkv,
                            const at::Tensor& w_o, const at::Tensor& post_norm_w,
                            const at::Tensor& w_gate_up, const at::Tensor& w_down, at::Tensor& k_cache,
                            at::Tensor& v_cache, const at::Tensor& prefix_len, const at::Tensor& parents,
                            const at::Tensor& positions, const at::Tensor& inv_freq, int64_t num_heads,
                            int64_t num_kv_heads, double eps) {
  LayerWeights w{in_norm_w, w_qkv, b_qkv, w_o, post_norm_w, w_gate_up, w_down};
  LayerInputs in{k_cache, v_cache, prefix_len, parents, positions, inv_freq, num_heads, num_kv_heads, eps};
  return decoder_layer_forward(x, w, in);
}

at::Tensor qdecoder_layer_op(const at::Tensor& x, const std::optional<at::Tensor>& in_norm_w,
                             const at::Tensor& w_qkv, const std::optional<at::Tensor>& b_qkv,
                             const at::Tensor& w_o, const at::Tensor& post_norm_w, const at::Tensor& w_gate_up,
                             const at::Tensor& w_down, const std::vector<std::string>& formats, bool x_int8,
                             at::Tensor& k_cache, at::Tensor& v_cache, const at::Tensor& prefix_len,
                             const at::Tensor& parents, const at::Tensor& positions, const at::Tensor& inv_freq,
                             int64_t num_heads, int64_t num_kv_heads, double eps) {
  TORCH_CHECK(formats.size() == 4, "formats must hold 4 entries (w_qkv, w_o, w_gate_up, w_down: \"\" for a "
              "float weight, else its qlinear format), got ", formats.size());
  LayerWeights w{in_norm_w, w_qkv, b_qkv, w_o, post_norm_w, w_gate_up, w_down};
  // Owned strings: a c10::string_view list read after unboxing pointed at freed memory (ASan).
  for (size_t i = 0; i < 4; ++i) w.formats[i] = formats[i];
  w.x_int8 = x_int8;
  LayerInputs in{k_cache, v_cache, prefix_len, parents, positions, inv_freq, num_heads, num_kv_heads, eps};
  return decoder_layer_forward(x, w, in);
}

at::Tensor specialist_forward_op(const at::Tensor& embeds, const at::Tensor& features,
                                 const at::Tensor& fc_w, const std::optional<at::Tensor>& fc_b,
                                 const at::Tensor& w_qkv, const at::Tensor& w_o,
                                 const at::Tensor& post_norm_w, const at::Tensor& w_gate_up,
                                 const at::Tensor& w_down, at::Tensor& k_cache, at::Tensor& v_cache,
                                 const at::Tensor& prefix_len, const at::Tensor& parents,
                                 const at::Tensor& positions, const at::Tensor& inv_freq,
                                 int64_t num_heads, int64_t num_kv_heads, double eps) {
  check_float_dtype(embeds, "embeds");
  check_dim(embeds, "embeds", 3, "[B, T, H]");
  TORCH_CHECK(features.sizes() == embeds.sizes(), "features must have embeds' shape ",
              shape_str(embeds), ", got ", shape_str(features));
  check_dtype(features, "features", embeds.scalar_type());
  check_same_device(features, "features", embeds, "embeds");
  const int64_t B = embeds.size(0), T = embeds.size(1), H = embeds.size(2);
  check_weight(fc_w, "fc_w", H, 2 * H, embeds);
  if (fc_b) check_vector(*fc_b, "fc_b", H, embeds);
  // Embedding first, then feature, as in EAGLE's fc([e; f]).
  const auto ef = at::cat({embeds.reshape({B * T, H}), features.reshape({B * T, H})}, 1);
  const auto u = call_linear(ef, fc_w, fc_b, std::nullopt).view({B, T, H});
  LayerWeights w{std::nullopt, w_qkv, std::nullopt, w_o, post_norm_w, w_gate_up, w_down};
  LayerInputs in{k_cache, v_cache, prefix_len, parents, positions, inv_freq, num_heads, num_kv_heads, eps};
  return decoder_layer_forward(u, w, in);
}

// EAGLE-3's decoder layer: QKV reads [input_norm(embeds); hidden_norm(hidden)] (2H features, the
// embedding first); the residual is the un-normalised hidden. The rest is decoder_layer_forward's.
at::Tensor eagle3_layer_forward_op(const at::Tensor& embeds, const at::Tensor& hidden,
                                   const at::Tensor& input_norm_w, const at::Tensor& hidden_norm_w,
                                   const at::Tensor& w_qkv, const at::Tensor& w_o,
                                   const at::Tensor& post_norm_w, const at::Tensor& w_gate_up,
                                   const at::Tensor& w_down, at::Tensor& k_cache, at::Tensor& v_cache,
                                   const at::Tensor& prefix_len, const at::Tensor& parents,
                                   const at::Tensor& positions, const at::Tensor& inv_freq,
                                   int64_t num_heads, int64_t num_kv_heads, double eps) {
  check_float_dtype(embeds, "embeds");
  check_dim(embeds, "embeds", 3, "[B, T, H]");
  TORCH_CHECK(hidden.sizes() == embeds.sizes(), "hidden must have embeds' shape ", shape_str(embeds),
              " (the fused target feature or the draft's own output, H wide), got ", shape_str(hidden));
  check_dtype(hidden, "hidden", embeds.scalar_type());
  check_same_device(hidden, "hidden", embeds, "embeds");
  const int64_t B = embeds.size(0), T = embeds.size(1), H = embeds.size(2);
  check_vector(input_norm_w, "input_norm_w", H, embeds);
  check_vector(hidden_norm_w, "hidden_norm_w", H, embeds);
  LayerWeights w{std::nullopt, w_qkv, std::nullopt, w_o, post_norm_w, w_gate_up, w_down};
  LayerInputs in{k_cache, v_cache, prefix_len, parents, positions, inv_freq, num_heads, num_kv_heads, eps};
  check_layer(hidden, w, in, 2 * H);
  if (B * T == 0) return at::empty({B, T, H}, hidden.options());
  const auto g2 = hidden.reshape({B * T, H});
  const auto a = at::cat({call_rms_norm(embeds.reshape({B * T, H}), input_norm_w, eps),
                          call_rms_norm(g2, hidden_norm_w, eps)}, 1);
  return layer_body(g2, a, B, T, w, in);
}

}  // namespace

// Built from other ops only, so one registration serves every device (and Meta, until a fake
// kernel overrides it).
TORCH_LIBRARY_IMPL(poss, CompositeExplicitAutograd, m) {
  m.impl("decoder_layer", &decoder_layer_op);
  m.impl("qdecoder_layer", &qdecoder_layer_op);
  m.impl("specialist_forward", &specialist_forward_op);
  m.impl("eagle3_layer_forward", &eagle3_layer_forward_op);
}

}  // namespace poss
