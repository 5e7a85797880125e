#include "algo/tree.h"

#include "algo/step_builders.h"

namespace pycoll {
using namespace steps;

namespace {

// The in-order binary tree on positions 1..n: position i sits at height lowbit(i), so odd
// positions are leaves; the root is the highest power of two <= n. Positions above n are
// skipped by climbing on to the next ancestor, which keeps every node at <= 2 children.
int lowbit(int i) { return i & -i; }

int tree_root(int n) {
  int r = 1;
  while (r * 2 <= n) r *= 2;
  return r;
}

int parent_position(int n, int i) {
  if (i == tree_root(n)) return 0;
  int p = i;
  do {
    const int b = lowbit(p);
    p = (p & (b << 1)) ? p - b : p + b;
  } while (p > n);
  return p;
}

// `pos_of(rank)` gives a rank's 1-based position, `rank_of(pos)` the inverse.
template <class PosOf, class RankOf>
TreeLinks links(int n, int rank, PosOf pos_of, RankOf rank_of) {
  TreeLinks l;
  const int i = pos_of(rank);
  const int p = parent_position(n, i);
  if (p != 0) l.parent = rank_of(p);
  int k = 0;
  for (int j = 1; j <= n; ++j)  // children in position order: left, then right
    if (j != i && parent_position(n, j) == i) l.child[k++] = rank_of(j);
  return l;
}

}  // namespace

TreeLinks double_tree_links(int n, int rank, int which) {
  if (which == 0) return links(n, rank, [](int r) { return r + 1; }, [](int i) { return i - 1; });
  if (n % 2 == 0)  // mirror: leaves of one tree are the interior nodes of the other
    return links(n, rank, [n](int r) { return n - r; }, [n](int i) { return n - i; });
  // shift by one (n odd): every rank but one is interior in at most one tree
  return links(n, rank, [n](int r) { return mod(r - 1, n) + 1; }, [n](int i) { return mod(i, n); });
}

TreeLinks rooted_tree_links(int n, int rank, int root) {
  // Rotate so that `root` lands on the tree's root position.
  const int shift = tree_root(n) - 1 - root;
  return links(
      n, rank, [n, shift](int r) { return mod(r + shift, n) + 1; },
      [n, shift](int i) { return mod(i - 1 - shift, n); });
}

namespace {

// Reduce towards the root: leaves send, interior nodes combine their children with their own
// data and pass it up, the root finishes it.
Step up_step(const TreeLinks& l, size_t off, size_t len) {
  if (l.nchildren() == 0) return send(l.parent, in(off), len, Wire::Acc);
  if (l.parent != kNoPeer) return recv_reduce_send(l.child[0], in(off), l.parent, len, l.child[1]);
  return recv_reduce_copy(l.child[0], in(off), out(off), len, l.child[1]);
}

// Broadcast away from the root. The root sends in this phase too, not as part of its up
// step: the two trees of an all-reduce share channels, and every message must sit in the
// same phase on both of its ends for the channel's order to agree.
void down_step(StepSink& sink, const TreeLinks& l, size_t off, size_t len) {
  if (l.parent == kNoPeer)
    emit(sink, send(l.child[0], out(off), len, Wire::Elem, l.child[1]));
  else if (l.nchildren() == 0)
    emit(sink, recv(l.parent, out(off), len));
  else
    emit(sink, recv_copy_send(l.parent, out(off), l.child[0], len, l.child[1]));
}

}  // namespace

void tree_allreduce(const ScheduleParams& p, StepSink& sink) {
  if (p.size == 1) {
    emit(sink, copy(in(0), out(0), p.count));
    return;
  }
  const TreeLinks t[2] = {double_tree_links(p.size, p.rank, 0),
                          double_tree_links(p.size, p.rank, 1)};
  const size_t half[2] = {(p.count + 1) / 2, p.count / 2};
  const size_t base[2] = {0, half[0]};
  // Piece by piece: both trees up, then both down, in the same order on every rank.
  for (size_t o = 0; o < half[0]; o += p.piece) {
    for (int k = 0; k < 2; ++k)
      emit(sink, up_step(t[k], base[k] + o, piece_len(half[k], o, p.piece)));
    for (int k = 0; k < 2; ++k) down_step(sink, t[k], base[k] + o, piece_len(half[k], o, p.piece));
  }
}

void tree_broadcast(const ScheduleParams& p, StepSink& sink) {
  if (p.size == 1) return;
  const TreeLinks l = rooted_tree_links(p.size, p.rank, p.root);
  for (size_t o = 0; o < p.count; o += p.piece) {
    down_step(sink, l, o, piece_len(p.count, o, p.piece));
  }
}

void tree_reduce(const ScheduleParams& p, StepSink& sink) {
  if (p.size == 1) {
    emit(sink, copy(in(0), out(0), p.count));
    return;
  }
  const TreeLinks l = rooted_tree_links(p.size, p.rank, p.root);
  for (size_t o = 0; o < p.count; o += p.piece)
    emit(sink, up_step(l, o, piece_len(p.count, o, p.piece)));
}

}  // namespace pycoll
