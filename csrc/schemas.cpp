// Every poss op's contract, in one place. Per-device kernels register their implementations in
// csrc/cpu/ and csrc/cuda/; fake (meta) kernels live next to the Python wrappers in poss_ext/ops.py.
//
// Tree encoding shared by all ops: per request b, N nodes in topological order; node 0 is the root
// (parents[b, 0] = -1), 0 <= parents[b, i] < i for real nodes, padding nodes (-2) come last.
#include <torch/library.h>

TORCH_LIBRARY(poss, m) {
  // Batched acceptance of a draft tree against the target's logits (greedy or exact sampling).
  // Sampling rows process the target's distribution as temperature, top-k, top-p, min-p (in that
  // order, see csrc/include/poss/acceptance.h).
  m.def(
      "tree_verify(Tensor parents, Tensor tokens, Tensor logits, Tensor? temperature=None, "
      "Tensor? top_k=None, Tensor? top_p=None, Tensor? uniforms=None, Tensor? min_p=None) "
      "-> (Tensor accept_nodes, Tensor accept_len, Tensor next_token)");

  // The EAGLE-2 dynamic tree: the top (num_nodes - 1) draft candidates, closed under ancestors,
  // in topological order behind the root.
  m.def(
      "build_tree(Tensor cand_tokens, Tensor cand_scores, Tensor cand_parents, Tensor root_token, "
      "int num_nodes) -> (Tensor tokens, Tensor parents, Tensor depth)");

  // Attention of the last Nq tree nodes over a KV cache prefix plus their ancestors in the tree.
  m.def(
      "tree_attention(Tensor q, Tensor k_cache, Tensor v_cache, Tensor prefix_len, Tensor parents, "
      "float scale) -> Tensor");

  // Moves the accepted path's KV to contiguous slots behind the prefix, for every layer, in place.
  m.def(
      "kv_compact(Tensor(a!) k_cache, Tensor(b!) v_cache, Tensor prefix_len, Tensor accept_nodes, "
      "Tensor accept_len) -> ()");

  // Decoder-layer building blocks. Rows are the last dimension; any leading shape. decoder_layer,
  // specialist_forward and eagle3_layer_forward are composites of the others: one CompositeExplicitAutograd kernel
  // serves every device (csrc/decoder_layer.cpp).

  // out = x @ weight^T + bias + residual: x [..., K], weight [N, K], bias [N], residual [..., N],
  // all one dtype; fp32 accumulation and one rounding. On a CPU with AVX512-BF16, bf16 runs a
  // kernel whose every output element is computed the same way whatever the number of rows, so a
  // token's logits in a tree verify are bit-identical to a single-token decode step's.
  m.def("linear(Tensor x, Tensor weight, Tensor? bias=None, Tensor? residual=None) -> Tensor");
  // The same with a weight in GGUF blocks: blocks [N, K / 32 * block bytes] uint8, as the file stores
  // them, format "q8_0", "q4_0" or "q4_1" (csrc/include/poss/qlinear_args.h); x [..., K] float32 /
  // bfloat16 / float16, bias and residual in x's dtype. CPU only. Every output element is computed the
  // same way whatever the number of rows, and a block with a non-finite scale is an error. x_int8:
  // x quantized per row and block of 32 to int8 (one fp32 scale each) and exact integer block dots
  // (csrc/cpu/qlinear.cpp); the same bits on every ISA.
  m.def("qlinear(Tensor x, Tensor blocks, str format, Tensor? bias=None, Tensor? residual=None, "
        "bool x_int8=False) -> Tensor");
  // out = x * rsqrt(mean(x^2) + eps) * weight, statistics in fp32.
  m.def("rms_norm(Tensor x, Tensor weight, float eps) -> Tensor");
  // sum = x + residual (rounded to x's dtype); out = rms_norm(sum, weight, eps).
  m.def("add_rms_norm(Tensor x, Tensor residual, Tensor weight, float eps) -> (Tensor out, Tensor sum)");
  // gate_up [..., 2F] (gate first, then up) -> silu(gate) * up [..., F].
  m.def("swiglu(Tensor gate_up) -> Tensor");
  // Splits a fused QKV projection [B, T, (Hq + 2 Hkv) D], applies rotate-half RoPE at `positions`
  // to q and k, writes k and v into the caches at slots start[b] + t, returns q as [B, Hq, T, D].
  m.def(
      "rope_qkv(Tensor qkv, Tensor positions, Tensor inv_freq, Tensor(a!) k_cache, Tensor(b!) v_cache, "
      "Tensor start, int num_heads, int num_kv_heads) -> Tensor");
  // One Llama/Qwen2/Mistral decoder layer over the last T nodes of a tree (prefill = chain tree):
  // optional input RMSNorm, fused QKV (+bias), RoPE, K/V written at slots prefix_len + N - T + t,
  // tree attention, o-proj + residual, post-attention RMSNorm, SwiGLU MLP, down-proj + residual.
  m.def(
      "decoder_layer(Tensor x, Tensor? in_norm_w, Tensor w_qkv, Tensor? b_qkv, Tensor w_o, "
      "Tensor post_norm_w, Tensor w_gate_up, Tensor w_down, Tensor(a!) k_cache, Tensor(b!) v_cache, "
      "Tensor prefix_len, Tensor parents, Tensor positions, Tensor inv_freq, int num_heads, "
      "int num_kv_heads, float eps) -> Tensor");
  // decoder_layer with any of its four projections in GGUF blocks: formats[i] (w_qkv, w_o, w_gate_up,
  // w_down) is "" for a float weight (poss::linear) or a qlinear format for blocks [N, K / 32 * B]
  // uint8 (poss::qlinear with x_int8); the same ops in the same order as decoder_layer.
  m.def(
      "qdecoder_layer(Tensor x, Tensor? in_norm_w, Tensor w_qkv, Tensor? b_qkv, Tensor w_o, "
      "Tensor post_norm_w, Tensor w_gate_up, Tensor w_down, str[] formats, bool x_int8, Tensor(a!) k_cache, "
      "Tensor(b!) v_cache, Tensor prefix_len, Tensor parents, Tensor positions, Tensor inv_freq, "
      "int num_heads, int num_kv_heads, float eps) -> Tensor");
  // One PosS specialist over T new tokens: u = fc([embeds; features]) then the decoder layer above
  // without input norm, on that specialist's own cache.
  m.def(
      "specialist_forward(Tensor embeds, Tensor features, Tensor fc_w, Tensor? fc_b, Tensor w_qkv, "
      "Tensor w_o, Tensor post_norm_w, Tensor w_gate_up, Tensor w_down, Tensor(a!) k_cache, "
      "Tensor(b!) v_cache, Tensor prefix_len, Tensor parents, Tensor positions, Tensor inv_freq, "
      "int num_heads, int num_kv_heads, float eps) -> Tensor");
  // One EAGLE-3 draft layer over T new tokens: q/k/v over [rms_norm(embeds, input_norm_w);
  // rms_norm(hidden, hidden_norm_w)] (2H features), RoPE, K/V written at slots prefix_len + N - T + t,
  // tree attention, o-proj + hidden (the residual), post-attention RMSNorm, SwiGLU MLP + residual.
  // hidden [B, T, H] is the fused target feature fc(three layers) or the draft's own output.
  m.def(
      "eagle3_layer_forward(Tensor embeds, Tensor hidden, Tensor input_norm_w, Tensor hidden_norm_w, "
      "Tensor w_qkv, Tensor w_o, Tensor post_norm_w, Tensor w_gate_up, Tensor w_down, "
      "Tensor(a!) k_cache, Tensor(b!) v_cache, Tensor prefix_len, Tensor parents, Tensor positions, "
      "Tensor inv_freq, int num_heads, int num_kv_heads, float eps) -> Tensor");
}
