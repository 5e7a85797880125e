// Tree schedules: a pipelined double binary tree for all-reduce (two trees, each carrying half
// the data, every rank a leaf in at least one), and pipelined binary trees for broadcast and
// reduce.
#pragma once

#include "algo/step.h"

namespace pycoll {

// A rank's place in a tree: its parent and up to two children (kNoPeer where absent).
struct TreeLinks {
  int parent = kNoPeer;
  int child[2] = {kNoPeer, kNoPeer};
  int nchildren() const { return (child[0] != kNoPeer) + (child[1] != kNoPeer); }
};

// Links of `rank` in tree `which` (0 or 1) of the double binary tree over `size` ranks.
TreeLinks double_tree_links(int size, int rank, int which);
// Links of `rank` in a binary tree over `size` ranks rooted at `root`.
TreeLinks rooted_tree_links(int size, int rank, int root);

void tree_allreduce(const ScheduleParams& p, StepSink& sink);
void tree_broadcast(const ScheduleParams& p, StepSink& sink);
void tree_reduce(const ScheduleParams& p, StepSink& sink);

}  // namespace pycoll
