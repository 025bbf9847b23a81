package tokenizer

// byteToRune is GPT-2's byte-level alphabet, which Hugging Face's ByteLevel pre-tokenizer uses:
// the printable bytes stand for themselves and the others (controls, space, 0x7F-0xA0, 0xAD)
// for U+0100 onwards, in byte order. The vocab spells tokens in it ("Ġthe" is " the").
var byteToRune [256]rune

// runeToByte inverts byteToRune; -1 for a rune outside the alphabet.
var runeToByte [324]int16

func init() {
	printable := func(b int) bool {
		return ('!' <= b && b <= '~') || (0xA1 <= b && b <= 0xAC) || (0xAE <= b && b <= 0xFF)
	}
	n := 0
	for b := 0; b < 256; b++ {
		if printable(b) {
			byteToRune[b] = rune(b)
		} else {
			byteToRune[b] = rune(256 + n)
			n++
		}
	}
	for i := range runeToByte {
		runeToByte[i] = -1
	}
	for b, r := range byteToRune {
		runeToByte[r] = int16(b)
	}
}
