// Plain structs that both kernels (host and device) use to address rows and read per-row inputs.
#pragma once

#include <cstdint>

#include "fused_is_math.h"

namespace fused_is {

// Rows of [B, T, V] or [N, V] logits with arbitrary strides: row r is (r / rows_per_seq, r % rows_per_seq),
// so a padded slice such as logits[:, :-1] that cannot be viewed as [N, V] needs no copy. int64 throughout:
// N x V beyond 2**31 elements must work.
struct Layout {
  int64_t rows, vocab, rows_per_seq, stride_seq, stride_row, stride_col;
  FIS_HD int64_t row_offset(int64_t row) const {
    return (row / rows_per_seq) * stride_seq + (row % rows_per_seq) * stride_row;
  }
};

// The per-row inputs as float64 vectors of length n: a contiguous [len(ROW_INPUTS), n] tensor whose rows are csrc/fused_is_math.h's
// FIS_ROW_INPUTS in order (packed by fused_is/backends/abi.py).
struct RowTable {
  const double* data;
  int64_t n;
  FIS_HD RowInputs at(int64_t row) const {
    RowInputs in;
    int64_t k = 0;
#define FIS_ROW_LOAD(name) in.name = data[(k++) * n + row];
    FIS_ROW_INPUTS(FIS_ROW_LOAD)
#undef FIS_ROW_LOAD
    return in;
  }
};

}  // namespace fused_is
