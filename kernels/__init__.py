"""Expert kernels. Each kernel has a plain-torch reference (`*_ref`) beside it and a test against it."""
