// SPDX-License-Identifier: MIT
// One translation unit for the fatbin: every kernel epd loads. Each file
// includes the device headers it needs (ekc_dev.cuh, ekc_op.cuh,
// ekc_ll.cuh), so the order below is free.
#include "ekc_barrier.cu"
#include "ekc_dispatch.cu"
#include "ekc_combine.cu"
#include "ekc_ll.cu"
#include "ekc_ll_combine.cu"
#include "ekc_llx.cu"
#include "ekc_copies.cu"
