// A POSIX shared-memory segment: created 0600 under an unguessable name, or opened by name.
#pragma once

#include <cstddef>
#include <cstdint>
#include <string>

namespace pycoll {

class ShmSegment {
 public:
  ShmSegment() = default;
  ShmSegment(const ShmSegment&) = delete;
  ShmSegment& operator=(const ShmSegment&) = delete;
  ShmSegment(ShmSegment&& o) noexcept { *this = static_cast<ShmSegment&&>(o); }
  ShmSegment& operator=(ShmSegment&& o) noexcept;
  ~ShmSegment();

  // Creates a segment of `bytes` named "/<prefix>-<uid>-<random>", backed by real pages
  // (checked against free space first, so a full /dev/shm is an error here, not a SIGBUS later).
  static ShmSegment create(const std::string& prefix, size_t bytes);
  // Maps an existing segment; its size must be exactly `bytes`.
  static ShmSegment open(const std::string& name, size_t bytes);

  // Removes the name; the mapping stays valid until this object goes away.
  void unlink();

  uint8_t* data() const { return data_; }
  size_t size() const { return size_; }
  const std::string& name() const { return name_; }
  bool owner() const { return owner_; }

 private:
  void release();

  std::string name_;
  uint8_t* data_ = nullptr;
  size_t size_ = 0;
  bool owner_ = false;   // we created it
  bool linked_ = false;  // its name still exists and we are responsible for removing it
};

}  // namespace pycoll
