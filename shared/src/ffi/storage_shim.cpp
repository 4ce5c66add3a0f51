// What PyTorch's FSDP does with `tensor.untyped_storage().resize_(0)` and `.resize_(n)`:
// release the memory of a storage in place and allocate it again later, so that every tensor
// viewing that storage — including the views autograd saved for backward — sees the new memory
// once it is refilled. tch has no binding for it: `Tensor::resize_` only ever grows a storage,
// and `Tensor::set_` repoints one tensor, not the views the graph holds. See
// src/parallel/fsdp/storage.rs (declared in src/ffi/storage.rs).
#include <ATen/core/Tensor.h>
#include <c10/core/DeviceGuard.h>
#include <c10/core/StorageImpl.h>

#include <cstring>
#include <exception>

#include "shim.h"

// `t` is tch's tensor handle (torch-sys's `tensor` is `at::Tensor *`). Sets the byte size of
// `t`'s storage to `nbytes`: 0 frees its memory; otherwise fresh memory is allocated with the
// storage's own allocator (its contents are undefined). Returns 0, or 1 with a message in `err`.
extern "C" int ladder_storage_resize_bytes(const at::Tensor *t, size_t nbytes, char *err, size_t errlen) {
  return ladder::guarded(err, errlen, [&] {
    c10::StorageImpl *s = t->storage().unsafeGetStorageImpl();
    TORCH_CHECK(s->resizable() && s->allocator() != nullptr,
                "the storage is not resizable (it was not allocated by libtorch)");
    if (nbytes == 0) {
      s->set_data_ptr_noswap(at::DataPtr(nullptr, s->device()));  // the old DataPtr frees the memory
      s->set_nbytes(0);
    } else {
      c10::OptionalDeviceGuard guard(s->device());
      at::DataPtr fresh = s->allocator()->allocate(nbytes);
      s->set_data_ptr_noswap(std::move(fresh));
      s->set_nbytes(nbytes);
    }
  });
}
