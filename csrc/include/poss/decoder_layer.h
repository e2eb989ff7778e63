// The fused decoder layer shared by the target runner (poss::decoder_layer) and the PosS draft
// (poss::specialist_forward). It is device-agnostic host code: GEMMs through ATen (oneDNN / cuBLAS)
// and the fused elementwise / attention kernels through the dispatcher.
#pragma once

#include <ATen/ATen.h>

#include <array>
#include <optional>
#include <string>

namespace poss {

struct LayerWeights {
  std::optional<at::Tensor> in_norm_w;  // [H]; absent for PosS specialists
  at::Tensor w_qkv;                     // [(Hq + 2 Hkv) D, H]
  std::optional<at::Tensor> b_qkv;      // [(Hq + 2 Hkv) D] (Qwen2)
  at::Tensor w_o;                       // [H, Hq D]
  at::Tensor post_norm_w;               // [H]
  at::Tensor w_gate_up;                 // [2F, H]
  at::Tensor w_down;                    // [H, F]
  // Per projection (w_qkv, w_o, w_gate_up, w_down): "" for a float weight, or the qlinear format of
  // its GGUF blocks [N, K / 32 * B] uint8 (poss::qdecoder_layer), run with x_int8.
  std::array<std::string, 4> formats{};
  bool x_int8 = false;
};

struct LayerInputs {
  at::Tensor k_cache, v_cache;  // [B, Hkv, S, D], written in place
  at::Tensor prefix_len;        // [B] int32
  at::Tensor parents;           // [B, N] int32; the T new tokens are its last T nodes
  at::Tensor positions;         // [B, T] int64
  at::Tensor inv_freq;          // [D / 2] float32
  int64_t num_heads, num_kv_heads;
  double eps;
};

// x: [B, T, H] -> [B, T, H].
at::Tensor decoder_layer_forward(const at::Tensor& x, const LayerWeights& w, LayerInputs& in);

}  // namespace poss
