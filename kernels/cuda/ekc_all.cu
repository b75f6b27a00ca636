// SPDX-License-Identifier: MIT
// One translation unit for the fatbin: every kernel epd loads.
#include "ekc_barrier.cu"
#include "ekc_dispatch.cu"
#include "ekc_ll.cu"
#include "ekc_llx.cu"
#include "ekc_copies.cu"
