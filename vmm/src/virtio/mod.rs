//! virtio-mmio transport and the `VirtioDevice` trait (owned by the virtio work;
//! this module is intentionally empty until that lands).
