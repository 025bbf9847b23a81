// Package filewatch notices that files were replaced, for settings a server reloads without a
// restart (TLS certificates, the credentials file, the Redis client certificate). It polls: a stat per file per interval costs
// nothing, works on every filesystem, and sees a Kubernetes secret volume's update (a symlink
// swapped to a new directory), which inotify on the old path would miss.
package filewatch

import (
	"context"
	"os"
	"time"
)

// Version is what tells one version of a file from the next: whether it exists, its size,
// modification time and identity (a replaced file, by rename or a symlink swap, has a new one).
// Versions compare with ==.
type Version struct {
	exists bool
	size   int64
	mtime  int64 // nanoseconds
	inode  any   // device and inode where the system has them
}

// Stat returns the version of the file at path now (the zero Version when it cannot be read). It
// follows symlinks, as a Kubernetes secret volume's files are.
func Stat(path string) Version {
	fi, err := os.Stat(path)
	if err != nil {
		return Version{}
	}
	return Version{exists: true, size: fi.Size(), mtime: fi.ModTime().UnixNano(), inode: inodeOf(fi)}
}

// Poll calls reload whenever one of paths changed since the last look, every interval, until ctx
// ends. The first look only records the files (the caller loaded them at start). A reload that
// fails is reported by reload itself; it is tried again at the files' next change, so a
// half-finished rotation (a new certificate before its key) succeeds once the second file lands.
func Poll(ctx context.Context, interval time.Duration, paths []string, reload func()) {
	last := make([]Version, len(paths))
	for i, p := range paths {
		last[i] = Stat(p)
	}
	t := time.NewTicker(interval)
	defer t.Stop()
	for {
		select {
		case <-ctx.Done():
			return
		case <-t.C:
		}
		changed := false
		for i, p := range paths {
			if s := Stat(p); s != last[i] {
				last[i], changed = s, true
			}
		}
		if changed {
			reload()
		}
	}
}
