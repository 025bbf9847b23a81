package filewatch

import (
	"os"
	"syscall"
)

// inodeOf is the file's device and inode, where the system has them.
func inodeOf(fi os.FileInfo) any {
	if st, ok := fi.Sys().(*syscall.Stat_t); ok {
		return [2]uint64{uint64(st.Dev), st.Ino}
	}
	return nil
}
