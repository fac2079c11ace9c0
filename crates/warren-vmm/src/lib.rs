//! warren-vmm
