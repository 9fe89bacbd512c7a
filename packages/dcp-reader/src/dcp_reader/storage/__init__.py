"""Where checkpoint bytes live: the storage seam (POSIX files, object stores)."""
