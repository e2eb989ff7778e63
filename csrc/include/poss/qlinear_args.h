// The GGUF block formats poss::qlinear reads, and its argument checks.
//
// A quantized weight [N, K] is N rows of K / 32 blocks, each block 32 consecutive weights of its row,
// stored as GGUF (ggml) writes them, little-endian:
//   q8_0: fp16 d, 32 x int8 q                  -> w = q * d                      (34 bytes)
//   q4_0: fp16 d, 16 bytes of 4-bit q          -> w = (q - 8) * d                (18 bytes)
//   q4_1: fp16 d, fp16 m, 16 bytes of 4-bit q  -> w = q * d + m                  (20 bytes)
// In the 4-bit formats, byte j holds weight j in its low nibble and weight j + 16 in its high nibble.
//
// Rows interleaved by 8 ("q8_0x8", "q4_0x8", "q4_1x8"; the loader's layout): the same bytes, permuted so that a vector whose lane k is weight row k loads without a transpose. N is a
// multiple of 8; the group of rows 8g .. 8g + 7 keeps its 8 * row bytes where the plain layout has
// them, and holds its blocks in order, block b at 8 * b * B bytes into the group:
//   the 8 rows' fp16 d (row k at 2k), q4_1: then the 8 rows' fp16 m (at 16 + 2k),
//   then the 8 rows' quant bytes (16, q8_0 32) as 4-byte words, word j of row k at 32j + 4k.
// poss_ext.ops.interleave_rows8 makes it from the plain layout; poss_ext.reference undoes it.
// Every product q * d above is exact in fp32 (at most 8 + 11 significant bits), so the weights as fp32
// are the values gguf's own dequantisation gives; q4_1's + m is one fp32 rounding (an FMA).
#pragma once

#include <ATen/ATen.h>

#include <optional>
#include <string>

#include "poss/arg_checks.h"

namespace poss {

enum class QFormat { Q8_0, Q4_0, Q4_1 };

constexpr int64_t kQBlock = 32;  // weights per block, every format

inline int64_t qblock_bytes(QFormat f) { return f == QFormat::Q8_0 ? 34 : f == QFormat::Q4_0 ? 18 : 20; }

// A format name: its block format, and whether its rows are interleaved by 8.
struct QLayout {
  QFormat format;
  bool rows8;
};

inline QLayout parse_qformat(const std::string& format) {
  if (format == "q8_0") return {QFormat::Q8_0, false};
  if (format == "q4_0") return {QFormat::Q4_0, false};
  if (format == "q4_1") return {QFormat::Q4_1, false};
  if (format == "q8_0x8") return {QFormat::Q8_0, true};
  if (format == "q4_0x8") return {QFormat::Q4_0, true};
  if (format == "q4_1x8") return {QFormat::Q4_1, true};
  TORCH_CHECK(false, "format must be one of 'q8_0', 'q4_0', 'q4_1', 'q8_0x8', 'q4_0x8', 'q4_1x8', got '", format,
              "'");
}

// x [..., K] float32 / bfloat16 / float16; blocks [N, K / 32 * block bytes] uint8; bias [N] and
// residual [..., N] in x's dtype; one device.
inline void check_qlinear(const at::Tensor& x, const at::Tensor& blocks, QLayout layout,
                          const std::optional<at::Tensor>& bias, const std::optional<at::Tensor>& residual) {
  const QFormat f = layout.format;
  TORCH_CHECK(at::isFloatingType(x.scalar_type()), "x must be float32, bfloat16 or float16, got ",
              x.scalar_type());
  TORCH_CHECK(x.dim() >= 1, "x must be [..., K], got a 0-D tensor");
  const int64_t K = x.size(-1);
  TORCH_CHECK(K % kQBlock == 0, "x.size(-1) (K) must be a multiple of the block size 32, got shape ",
              shape_str(x));
  check_dim(blocks, "blocks", 2, "[N, K / 32 * block bytes] uint8");
  check_dtype(blocks, "blocks", at::kByte);
  check_same_device(blocks, "blocks", x, "x");
  const int64_t row_bytes = K / kQBlock * qblock_bytes(f);
  TORCH_CHECK(blocks.size(1) == row_bytes, "blocks.size(1) must equal K / 32 * ", qblock_bytes(f),
              " (the bytes of a row of ", K / kQBlock, " blocks of this format) = ", row_bytes, ", got shape ",
              shape_str(blocks));
  const int64_t N = blocks.size(0);
  TORCH_CHECK(!layout.rows8 || N % 8 == 0, "blocks.size(0) (N) must be a multiple of 8 in a format with rows "
              "interleaved by 8 ('q8_0x8', 'q4_0x8', 'q4_1x8'), got shape ", shape_str(blocks));
  if (bias) {
    check_dim(*bias, "bias", 1, "[N]");
    check_size(*bias, "bias", 0, N, "blocks.size(0) (N)");
    check_dtype(*bias, "bias", x.scalar_type());
    check_same_device(*bias, "bias", x, "x");
  }
  if (residual) {
    auto want = x.sizes().vec();
    want.back() = N;
    TORCH_CHECK(residual->sizes() == at::IntArrayRef(want), "residual must be [..., N] = ", at::IntArrayRef(want),
                ", got shape ", shape_str(*residual));
    check_dtype(*residual, "residual", x.scalar_type());
    check_same_device(*residual, "residual", x, "x");
  }
}

// The kernel poss::qlinear runs on this CPU: "avx512" (AVX512F + BW), "avx2" (AVX2 + FMA + F16C) or
// "scalar". All three compute every output element in the same order and give the same bits. With
// x_int8 (int8 activations): "amx" (AMX-INT8, granted by the OS, + AVX512-VNNI), "avx512vnni"
// (AVX512-VNNI + VL), "avx2" or "scalar" (an AVX512 CPU without VNNI runs the AVX2 int8 kernel).
const char* cpu_qlinear_kernel(bool x_int8 = false);

// Forces a kernel ("amx", "avx512vnni", "avx512", "avx2", "scalar"; "" = the best this CPU has), for tests
// and timings; "amx" and "avx512vnni" run the AVX512 kernel for fp32 activations, "avx512" the AVX2 one
// for int8.
// Raises for a kernel this CPU cannot run.
void force_cpu_qlinear_kernel(const std::string& name);

}  // namespace poss
