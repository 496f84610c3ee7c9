// BoundedSet: remembers at most its capacity, forgetting the oldest first.
#include "test_util.h"

#include "tandem/rpc/common/bounded_set.h"

using tandem::rpc::BoundedSet;

TEST_CASE("bounded set: forgets the oldest first, and erase does not make it forget early") {
  BoundedSet<int> s(3);
  CHECK(s.insert(1));
  CHECK_FALSE(s.insert(1));
  CHECK(s.insert(2));
  CHECK(s.insert(3));
  CHECK(s.insert(4));  // 1 goes
  CHECK_FALSE(s.contains(1));
  CHECK(s.contains(2));
  CHECK(s.size() == 3);
  CHECK(s.erase(2));
  CHECK_FALSE(s.erase(2));
  CHECK(s.insert(2));  // back, now the newest
  CHECK(s.insert(5));  // 3 goes (the stale entry of the first 2 is skipped)
  CHECK(s.insert(6));  // then 4
  CHECK_FALSE(s.contains(3));
  CHECK_FALSE(s.contains(4));
  CHECK(s.contains(2));
  CHECK(s.contains(5));
  CHECK(s.contains(6));
  // Erasing and inserting for ever stays bounded.
  for (int i = 0; i < 10000; ++i) {
    s.insert(100 + i);
    s.erase(100 + i);
  }
  CHECK(s.size() <= 3);
}
