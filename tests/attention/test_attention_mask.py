"""The masked tiles' bands (csrc/attention/attention_mask.h), compiled from the header with the
host C++ compiler and checked on the CPU against the per-pair rule they replace: for every row
of a tile (a query, rows before the sequence's start included), every column offset c in
[0, span) and every mask (no bound, causal, sliding windows, right-only and left-only windows,
lq < lk and lq > lk), keys_band(i, base, span).has(c) == pair_visible(i, base + c). The sm90
forward's masked paths select with the bands; a wrong bound would show on the GPU only as a few
wrong probabilities on diagonal tiles.
"""
from host_cxx import run_program

PROGRAM = r"""
#include "attention_mask.h"
#include <cstdio>
#include <initializer_list>
using namespace fusedops::attn;

int main() {
  long checked = 0, bad = 0;
  const int lens[] = {1, 7, 64, 97, 128, 300};
  const int bounds[] = {-1, 0, 1, 5, 64, 200, 1000};
  for (int lq : lens)
    for (int lk : lens)
      for (int left : bounds)
        for (int right : bounds) {
          const int off = lk - lq;
          for (int span : {64, 80, 128, 176})
            for (int base = 0; base < lk + span; base += 37) {
              for (int i = -200; i < lq + 8; i += 3) {  // forward rows (i < 0: before the start)
                const Band b = keys_band(i, base, span, lk, off, left, right);
                for (int c = 0; c < span; ++c) {
                  const bool want = pair_visible(i, base + c, lk, off, left, right);
                  bad += b.has(c) != want;
                  ++checked;
                }
              }
            }
        }
  std::printf("checked %ld failed %ld\n", checked, bad);
  return bad != 0;
}
"""


def test_bands_equal_the_pairwise_mask(tmp_path):
    assert "failed 0" in run_program(tmp_path, PROGRAM)
