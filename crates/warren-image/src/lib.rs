//! Guest images: recipes, builds, digests and the image store.
