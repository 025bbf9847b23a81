package enginefeed

import (
	"encoding/binary"
	"fmt"
)

// checkFraming walks a payload's MessagePack framing once, without decoding or allocating, and fails
// unless it is exactly one object whose every declared length (of a string, binary, extension,
// array or map) fits in the bytes that follow. The msgpack library sizes its buffers from declared
// lengths: an 87-byte payload declaring a 2 GB extension made a skip allocate 2 GB (FuzzDecode found
// it). Checked first, every length the decoder later meets is at most the payload's.
func checkFraming(p []byte) error {
	pending := uint64(1) // objects still to read
	i := 0
	for pending > 0 {
		if i >= len(p) {
			return fmt.Errorf("the payload ends inside an object (%d bytes)", len(p))
		}
		at, c := i, p[i]
		i++
		pending--
		var size uint64 // bytes of the object after its header
		var items uint64
		switch {
		case c <= 0x7f || c >= 0xe0, c == 0xc0, c == 0xc2, c == 0xc3: // fixints, nil, bools
		case c >= 0x80 && c <= 0x8f:
			items = 2 * uint64(c&0x0f)
		case c >= 0x90 && c <= 0x9f:
			items = uint64(c & 0x0f)
		case c >= 0xa0 && c <= 0xbf:
			size = uint64(c & 0x1f)
		default:
			n, width, extra := 0, 0, uint64(0) // length bytes, fixed size, extension type byte
			switch c {
			case 0xc4, 0xd9:
				n = 1
			case 0xc5, 0xda:
				n = 2
			case 0xc6, 0xdb:
				n = 4
			case 0xc7:
				n, extra = 1, 1
			case 0xc8:
				n, extra = 2, 1
			case 0xc9:
				n, extra = 4, 1
			case 0xca, 0xce, 0xd2:
				width = 4
			case 0xcb, 0xcf, 0xd3:
				width = 8
			case 0xcc, 0xd0:
				width = 1
			case 0xcd, 0xd1:
				width = 2
			case 0xd4, 0xd5, 0xd6, 0xd7, 0xd8:
				width = 1 + 1<<(c-0xd4) // type byte and 1, 2, 4, 8 or 16 data bytes
			case 0xdc, 0xde:
				n = 2
			case 0xdd, 0xdf:
				n = 4
			default: // 0xc1, never used
				return fmt.Errorf("byte %d: 0x%02x is not a MessagePack type", at, c)
			}
			if len(p)-i < n {
				return fmt.Errorf("byte %d: the payload ends inside a length", at)
			}
			var length uint64
			switch n {
			case 1:
				length = uint64(p[i])
			case 2:
				length = uint64(binary.BigEndian.Uint16(p[i:]))
			case 4:
				length = uint64(binary.BigEndian.Uint32(p[i:]))
			}
			i += n
			switch c {
			case 0xdc, 0xdd:
				items = length
			case 0xde, 0xdf:
				items = 2 * length
			default:
				size = uint64(width) + extra + length
				if width > 0 {
					size = uint64(width)
				}
			}
		}
		left := uint64(len(p) - i)
		if size > left || items > left { // every item takes at least one byte
			return fmt.Errorf("byte %d: declares %d bytes or items, but %d bytes follow", at, max(size, items), left)
		}
		i += int(size)
		pending += items
	}
	if i != len(p) {
		return fmt.Errorf("%d bytes after the batch", len(p)-i)
	}
	return nil
}
