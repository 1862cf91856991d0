// Parallel loops split by work rather than by count.
//
// at::parallel_for hands each thread an equal number of items. Freight's batches are sorted by length, so
// the items of one call (sequences, or blocks of query rows whose keys grow with their position) cost more
// the later they come: split by count, one thread finishes its short items and waits for the other (a
// length-sorted decode batch ran 1.35x slower than the same batch shuffled, 2 threads). Here each thread
// gets one contiguous range of near-equal total cost, so items stay in order and each thread walks
// neighbouring memory.
#pragma once

#include <ATen/Parallel.h>

#include <algorithm>
#include <cstdint>
#include <vector>

namespace freight {

// fn(begin, end) over [0, n) in at most at::get_num_threads() ranges; cost(i) >= 0 is item i's relative work.
template <typename Cost, typename Fn>
void parallel_for_balanced(int64_t n, const Cost& cost, const Fn& fn) {
  const int64_t threads = std::min<int64_t>(at::get_num_threads(), n);
  if (threads <= 1 || at::in_parallel_region()) {
    if (n > 0) fn(int64_t{0}, n);
    return;
  }
  std::vector<double> prefix(n + 1, 0.0);  // prefix[i]: cost of items [0, i)
  for (int64_t i = 0; i < n; ++i) prefix[i + 1] = prefix[i] + static_cast<double>(cost(i));
  std::vector<int64_t> bounds(threads + 1, n);
  bounds[0] = 0;
  for (int64_t t = 1; t < threads; ++t) {
    // the first item that starts at or past thread t's share of the total
    const double share = prefix[n] * static_cast<double>(t) / static_cast<double>(threads);
    bounds[t] = std::lower_bound(prefix.begin(), prefix.end() - 1, share) - prefix.begin();
    bounds[t] = std::max(bounds[t], bounds[t - 1]);
  }
  at::parallel_for(0, threads, 1, [&](int64_t first, int64_t last) {
    for (int64_t t = first; t < last; ++t)
      if (bounds[t] < bounds[t + 1]) fn(bounds[t], bounds[t + 1]);
  });
}

}  // namespace freight
