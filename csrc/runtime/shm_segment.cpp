#include "runtime/shm_segment.h"

#include <fcntl.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <sys/statvfs.h>
#include <unistd.h>

#include <cerrno>
#include <cstdio>
#include <cstring>
#include <random>

#include "common/errors.h"

namespace pycoll {
namespace {

std::string random_hex(int bytes) {
  std::random_device rd;  // reads the OS entropy source
  std::string s;
  static const char* hex = "0123456789abcdef";
  for (int i = 0; i < bytes; ++i) {
    unsigned v = rd() & 0xff;
    s += hex[v >> 4];
    s += hex[v & 15];
  }
  return s;
}

std::string os_error(const char* what, const std::string& name) {
  return str_cat(what, " ", name, ": ", std::strerror(errno));
}

// What to do about it (python -m pycollectives.doctor -n N predicts it before a job).
constexpr const char* kRemedy =
    ". Give the job a larger /dev/shm (docker run --shm-size=1g; Kubernetes: an emptyDir of "
    "medium Memory on /dev/shm) or smaller staging (PYCOLL_STAGING_BYTES, PYCOLL_STAGING_SLOTS); "
    "python -m pycollectives.doctor -n RANKS says what a job needs";

// Reserves the pages so that running out of /dev/shm shows up now, with numbers.
void reserve(int fd, const std::string& name, size_t bytes) {
  struct statvfs vfs{};
  if (fstatvfs(fd, &vfs) == 0) {
    const unsigned long long avail = static_cast<unsigned long long>(vfs.f_bavail) *
                                     static_cast<unsigned long long>(vfs.f_frsize);
    if (avail < bytes)
      throw CollectiveError(str_cat("not enough shared memory for ", name, ": need ", bytes,
                                    " bytes, /dev/shm has ", avail, " bytes available", kRemedy));
  }
  int rc = posix_fallocate(fd, 0, static_cast<off_t>(bytes));
  if (rc != 0) {
    unsigned long long avail = 0;
    if (fstatvfs(fd, &vfs) == 0)
      avail = static_cast<unsigned long long>(vfs.f_bavail) *
              static_cast<unsigned long long>(vfs.f_frsize);
    throw CollectiveError(str_cat("cannot reserve shared memory for ", name, ": need ", bytes,
                                  " bytes, /dev/shm has ", avail, " bytes available (",
                                  std::strerror(rc), ")", kRemedy));
  }
}

uint8_t* map(int fd, size_t bytes, const std::string& name) {
  void* p = mmap(nullptr, bytes, PROT_READ | PROT_WRITE, MAP_SHARED, fd, 0);
  if (p == MAP_FAILED) throw CollectiveError(os_error("cannot map shared memory", name));
  return static_cast<uint8_t*>(p);
}

}  // namespace

ShmSegment& ShmSegment::operator=(ShmSegment&& o) noexcept {
  if (this != &o) {
    release();
    name_ = std::move(o.name_);
    data_ = o.data_;
    size_ = o.size_;
    owner_ = o.owner_;
    linked_ = o.linked_;
    o.data_ = nullptr;
    o.size_ = 0;
    o.linked_ = false;
  }
  return *this;
}

ShmSegment::~ShmSegment() { release(); }

void ShmSegment::release() {
  if (data_ != nullptr) munmap(data_, size_);
  data_ = nullptr;
  size_ = 0;
  unlink();
}

namespace {
// Closes a descriptor when it goes (the mapping stays valid without it).
struct FdCloser {
  int fd;
  ~FdCloser() { close(fd); }
};
}  // namespace

ShmSegment ShmSegment::create(const std::string& prefix, size_t bytes) {
  ShmSegment seg;
  seg.name_ = str_cat("/", prefix, "-", getuid(), "-", random_hex(12));
  const int fd = shm_open(seg.name_.c_str(), O_CREAT | O_EXCL | O_RDWR, 0600);
  if (fd < 0) throw CollectiveError(os_error("cannot create shared memory", seg.name_));
  const FdCloser closer{fd};
  seg.owner_ = true;
  seg.linked_ = true;  // from here on, the destructor removes the name
  if (ftruncate(fd, static_cast<off_t>(bytes)) != 0)
    throw CollectiveError(os_error("cannot size shared memory", seg.name_));
  reserve(fd, seg.name_, bytes);
  seg.data_ = map(fd, bytes, seg.name_);
  seg.size_ = bytes;
  return seg;
}

ShmSegment ShmSegment::open(const std::string& name, size_t bytes) {
  ShmSegment seg;
  seg.name_ = name;
  const int fd = shm_open(name.c_str(), O_RDWR, 0);
  if (fd < 0) throw CollectiveError(os_error("cannot open shared memory", name));
  const FdCloser closer{fd};
  struct stat st{};
  if (fstat(fd, &st) != 0) throw CollectiveError(os_error("cannot stat shared memory", name));
  if (static_cast<size_t>(st.st_size) != bytes)
    throw CollectiveError(str_cat("shared memory ", name, " has ", st.st_size, " bytes, expected ",
                                  bytes, " (ranks disagree on the staging configuration?)"));
  seg.data_ = map(fd, bytes, name);
  seg.size_ = bytes;
  return seg;
}

void ShmSegment::unlink() {
  if (linked_) {
    shm_unlink(name_.c_str());
    linked_ = false;
  }
}

}  // namespace pycoll
