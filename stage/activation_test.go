package stage

import (
	"encoding/binary"
	"math"
	"math/rand/v2"
	"slices"
	"sort"
	"strings"
	"testing"
	"unsafe"
)

// halfValue decodes an IEEE 754 binary16 from its fields with float64
// arithmetic, independently of F16ToFloat32, so that the codec is checked
// against the definition rather than against itself.
func halfValue(h uint16) float64 {
	sign := 1.0
	if h&0x8000 != 0 {
		sign = -1
	}
	exp := int(h>>10) & 0x1f
	mant := float64(h & 0x3ff)
	switch {
	case exp == 0x1f && mant == 0:
		return math.Inf(int(sign))
	case exp == 0x1f:
		return math.NaN()
	case exp == 0:
		return sign * math.Ldexp(mant, -24) // subnormal: mant × 2^-24
	default:
		return sign * math.Ldexp(1+mant/1024, exp-15)
	}
}

func isNaN32(f float32) bool { return f != f }

// TestF16Exact pins the conversions at the values where a half-precision
// codec typically goes wrong: signed zero, the largest finite value and the
// overflow threshold, the subnormal range and its rounding, NaN.
func TestF16Exact(t *testing.T) {
	tests := []struct {
		name string
		in   float32
		want uint16
	}{
		{"zero", 0, 0x0000},
		{"negative zero", float32(math.Copysign(0, -1)), 0x8000},
		{"one", 1, 0x3c00},
		{"minus two", -2, 0xc000},
		{"one third rounds down", 1.0 / 3, 0x3555},
		{"largest finite", 65504, 0x7bff},
		// 65520 lies exactly between 65504 and 65536 (which does not exist):
		// ties go to the even mantissa, which carries into infinity.
		{"65520 overflows", 65520, 0x7c00},
		{"just below 65520 stays finite", math.Nextafter32(65520, 0), 0x7bff},
		{"negative overflow", -1e6, 0xfc00},
		{"infinity", float32(math.Inf(1)), 0x7c00},
		{"negative infinity", float32(math.Inf(-1)), 0xfc00},
		{"smallest normal", float32(math.Ldexp(1, -14)), 0x0400},
		{"largest subnormal", float32(math.Ldexp(1023, -24)), 0x03ff},
		// Just under the smallest normal, a value rounds up into it.
		{"subnormal carries into normal", float32(math.Ldexp(2047, -25)), 0x0400},
		{"smallest subnormal", float32(math.Ldexp(1, -24)), 0x0001},
		{"negative smallest subnormal", -float32(math.Ldexp(1, -24)), 0x8001},
		// 2^-25 is half the smallest subnormal: the tie goes to even (zero).
		{"2^-25 ties to zero", float32(math.Ldexp(1, -25)), 0x0000},
		{"-2^-25 ties to negative zero", -float32(math.Ldexp(1, -25)), 0x8000},
		{"just above 2^-25 rounds up", math.Nextafter32(float32(math.Ldexp(1, -25)), 1), 0x0001},
		// 3×2^-25 is between subnormals 1 and 2: the tie goes to 2.
		{"3×2^-25 ties to even", float32(math.Ldexp(3, -25)), 0x0002},
		// 5×2^-25 is between subnormals 2 and 3: the tie goes to 2.
		{"5×2^-25 ties to even", float32(math.Ldexp(5, -25)), 0x0002},
		{"2^-26 underflows", float32(math.Ldexp(1, -26)), 0x0000},
		{"float32 subnormal underflows", math.SmallestNonzeroFloat32, 0x0000},
		// 1 + 2^-11 is halfway between 1 and 1+2^-10: ties to even (1).
		{"normal tie to even down", 1 + float32(math.Ldexp(1, -11)), 0x3c00},
		// 1 + 3×2^-11 is halfway between 1+2^-10 and 1+2^-9: ties to even (up).
		{"normal tie to even up", 1 + float32(math.Ldexp(3, -11)), 0x3c02},
		{"max float32", math.MaxFloat32, 0x7c00},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			if got := Float32ToF16(tt.in); got != tt.want {
				t.Errorf("Float32ToF16(%g) = %#04x, want %#04x", tt.in, got, tt.want)
			}
		})
	}
}

func TestF16NaN(t *testing.T) {
	nans := []uint32{0x7fc00000, 0x7f800001, 0xffc00000, 0x7fbfffff, 0xff800001}
	for _, bits := range nans {
		f := math.Float32frombits(bits)
		h := Float32ToF16(f)
		// A NaN whose payload sits only in the low 13 bits must not turn
		// into infinity when those bits are dropped.
		if h&0x7c00 != 0x7c00 || h&0x3ff == 0 {
			t.Errorf("Float32ToF16(%#08x) = %#04x, not a NaN", bits, h)
		}
		if (h&0x8000 != 0) != (bits&0x80000000 != 0) {
			t.Errorf("Float32ToF16(%#08x) = %#04x lost the sign", bits, h)
		}
		if !isNaN32(F16ToFloat32(h)) {
			t.Errorf("F16ToFloat32(%#04x) is not NaN", h)
		}
	}
}

// TestF16Exhaustive decodes every one of the 65536 halves, compares it with
// the definition, and encodes it back: every non-NaN half must survive the
// round trip bit for bit (signed zeros and infinities included), and every
// NaN must stay a NaN of the same sign (its payload is not kept).
func TestF16Exhaustive(t *testing.T) {
	for i := range 1 << 16 {
		h := uint16(i)
		f := F16ToFloat32(h)
		want := halfValue(h)
		if math.IsNaN(want) {
			if !isNaN32(f) {
				t.Fatalf("F16ToFloat32(%#04x) = %g, want NaN", h, f)
			}
			back := Float32ToF16(f)
			if back&0x7c00 != 0x7c00 || back&0x3ff == 0 || back&0x8000 != h&0x8000 {
				t.Fatalf("NaN %#04x came back as %#04x", h, back)
			}
			continue
		}
		if float64(f) != want || math.Signbit(float64(f)) != (h&0x8000 != 0) {
			t.Fatalf("F16ToFloat32(%#04x) = %g, want %g", h, f, want)
		}
		if back := Float32ToF16(f); back != h {
			t.Fatalf("round trip %#04x -> %g -> %#04x", h, f, back)
		}
	}
}

// TestF16RoundingEverywhere checks round-to-nearest-even at every tie of the
// whole positive range: the midpoint of two adjacent halves is exact in
// float32 (12 significant bits), must go to the one with the even
// mantissa, and the float32 neighbours on either side of it must go to the
// nearer half. The last midpoint (65504 to 65536) is the overflow threshold.
func TestF16RoundingEverywhere(t *testing.T) {
	for h := uint16(0); h < 0x7c00; h++ {
		lo := halfValue(h)
		hi := halfValue(h + 1) // 0x7c00 is +Inf; its "value" for rounding is 65536
		if h+1 == 0x7c00 {
			hi = 65536
		}
		mid := float32((lo + hi) / 2)
		if float64(mid) != (lo+hi)/2 {
			t.Fatalf("midpoint of %#04x and %#04x is not exact in float32", h, h+1)
		}
		even := h
		if h&1 == 1 {
			even = h + 1
		}
		if got := Float32ToF16(mid); got != even {
			t.Fatalf("midpoint %g of %#04x,%#04x -> %#04x, want %#04x", mid, h, h+1, got, even)
		}
		if got := Float32ToF16(math.Nextafter32(mid, 0)); got != h {
			t.Fatalf("just below midpoint %g -> %#04x, want %#04x", mid, got, h)
		}
		if got := Float32ToF16(math.Nextafter32(mid, float32(math.Inf(1)))); got != h+1 {
			t.Fatalf("just above midpoint %g -> %#04x, want %#04x", mid, got, h+1)
		}
		// Negative values round symmetrically.
		if got := Float32ToF16(-mid); got != even|0x8000 {
			t.Fatalf("midpoint %g -> %#04x, want %#04x", -mid, got, even|0x8000)
		}
	}
}

// TestF16RandomAgainstNearest compares Float32ToF16 on random float32 bit
// patterns with a brute-force nearest-half search over the sorted table of
// all finite halves.
func TestF16RandomAgainstNearest(t *testing.T) {
	var table []float64 // positive finite halves, ascending; index = bits
	for h := range 0x7c00 {
		table = append(table, halfValue(uint16(h)))
	}
	rng := rand.New(rand.NewPCG(1, 2))
	for range 200000 {
		bits := rng.Uint32()
		f := math.Float32frombits(bits)
		if isNaN32(f) {
			continue
		}
		a := math.Abs(float64(f))
		var want uint16
		switch {
		case a >= 65520: // at or past the last midpoint
			want = 0x7c00
		default:
			i := sort.SearchFloat64s(table, a) // first >= a
			switch {
			case i < len(table) && table[i] == a:
				want = uint16(i)
			case i == 0:
				want = 0
			default:
				dLo, dHi := a-table[i-1], table[i]-a
				want = uint16(i)
				if dLo < dHi || dLo == dHi && (i-1)%2 == 0 {
					want = uint16(i - 1)
				}
			}
		}
		if bits&0x80000000 != 0 {
			want |= 0x8000
		}
		if got := Float32ToF16(f); got != want {
			t.Fatalf("Float32ToF16(%g = %#08x) = %#04x, want %#04x", f, bits, got, want)
		}
	}
}

func TestBF16(t *testing.T) {
	tests := []struct {
		name string
		in   float32
		want uint16
	}{
		{"zero", 0, 0x0000},
		{"negative zero", float32(math.Copysign(0, -1)), 0x8000},
		{"one", 1, 0x3f80},
		{"minus one", -1, 0xbf80},
		{"infinity", float32(math.Inf(1)), 0x7f80},
		{"negative infinity", float32(math.Inf(-1)), 0xff80},
		// 1 + 2^-8 is halfway between 1 and 1+2^-7: ties to even (1).
		{"tie to even down", 1 + float32(math.Ldexp(1, -8)), 0x3f80},
		// 1 + 3×2^-8 is halfway between 1+2^-7 and 1+2^-6: ties to even (up).
		{"tie to even up", 1 + float32(math.Ldexp(3, -8)), 0x3f82},
		{"above tie rounds up", math.Nextafter32(1+float32(math.Ldexp(1, -8)), 2), 0x3f81},
		{"below tie rounds down", math.Nextafter32(1+float32(math.Ldexp(3, -8)), 0), 0x3f81},
		// The largest float32 is past bfloat16's last midpoint.
		{"max float32 overflows", math.MaxFloat32, 0x7f80},
		{"smallest float32 subnormal", math.SmallestNonzeroFloat32, 0x0000},
		{"pi", math.Pi, 0x4049},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			if got := Float32ToBF16(tt.in); got != tt.want {
				t.Errorf("Float32ToBF16(%g) = %#04x, want %#04x", tt.in, got, tt.want)
			}
		})
	}
	for _, bits := range []uint32{0x7fc00000, 0x7f800001, 0xff800001, 0x7f80ffff} {
		h := Float32ToBF16(math.Float32frombits(bits))
		if !isNaN32(BF16ToFloat32(h)) || (h&0x8000 != 0) != (bits&0x80000000 != 0) {
			t.Errorf("NaN %#08x -> %#04x", bits, h)
		}
	}
}

// TestBF16Exhaustive: bfloat16 is the top half of a float32, so decoding is
// a shift and every non-NaN value must come back bit for bit.
func TestBF16Exhaustive(t *testing.T) {
	for i := range 1 << 16 {
		h := uint16(i)
		f := BF16ToFloat32(h)
		if math.Float32bits(f) != uint32(h)<<16 {
			t.Fatalf("BF16ToFloat32(%#04x) = %#08x", h, math.Float32bits(f))
		}
		back := Float32ToBF16(f)
		if isNaN32(f) {
			if !isNaN32(BF16ToFloat32(back)) || back&0x8000 != h&0x8000 {
				t.Fatalf("NaN %#04x came back as %#04x", h, back)
			}
			continue
		}
		if back != h {
			t.Fatalf("round trip %#04x -> %g -> %#04x", h, f, back)
		}
	}
}

// TestCodecRoundTrip encodes and decodes vectors in each dtype: f32 is
// lossless, and the 16-bit types must land on the value their scalar
// conversion gives (so Encode/Decode apply it to every element, in order).
func TestCodecRoundTrip(t *testing.T) {
	rng := rand.New(rand.NewPCG(3, 4))
	in := make([]float32, 1000)
	for i := range in {
		in[i] = float32(rng.NormFloat64() * 10)
	}
	in = append(in, 0, float32(math.Copysign(0, -1)), 65504, -65504, 1e-7, float32(math.Inf(1)))
	for _, dt := range []DType{F32, F16, BF16} {
		t.Run(dt.String(), func(t *testing.T) {
			prefix := []byte{0xaa}
			data, err := Encode(dt, in, prefix)
			if err != nil {
				t.Fatal(err)
			}
			if len(data) != 1+len(in)*dt.Size() || data[0] != 0xaa {
				t.Fatalf("Encode appended %d bytes, want %d after the prefix", len(data)-1, len(in)*dt.Size())
			}
			out, err := Decode(dt, data[1:], []float32{42})
			if err != nil {
				t.Fatal(err)
			}
			if len(out) != 1+len(in) || out[0] != 42 {
				t.Fatalf("Decode appended %d values", len(out)-1)
			}
			for i, v := range in {
				var want float32
				switch dt {
				case F32:
					want = v
				case F16:
					want = F16ToFloat32(Float32ToF16(v))
				case BF16:
					want = BF16ToFloat32(Float32ToBF16(v))
				}
				if math.Float32bits(out[1+i]) != math.Float32bits(want) {
					t.Fatalf("element %d: %g -> %g, want %g", i, v, out[1+i], want)
				}
				// The relative error of a normal value is at most half an ulp.
				if dt != F32 && math.Abs(float64(v)) > 1e-4 && math.Abs(float64(v)) < 60000 {
					bound := map[DType]float64{F16: 1.0 / 2048, BF16: 1.0 / 256}[dt]
					if rel := math.Abs(float64(out[1+i]-v)) / math.Abs(float64(v)); rel > bound {
						t.Fatalf("element %d: %g -> %g, relative error %g over %g", i, v, out[1+i], rel, bound)
					}
				}
			}

			a, err := NewActivation(dt, 2, 3, []float32{1, 2, 3, 4, 5, 6})
			if err != nil {
				t.Fatal(err)
			}
			got, err := a.Float32()
			if err != nil || !slices.Equal(got, []float32{1, 2, 3, 4, 5, 6}) {
				t.Fatalf("activation round trip: %v %v", got, err)
			}
		})
	}
}

// TestCodecF16Loops checks Encode and Decode's F16 loops, whose normal
// values skip Float32ToF16 and F16ToFloat32, against those functions bit
// for bit: every half; and every float32 exponent and sign, with every top
// ten mantissa bits (the half's mantissa, which a rounding carry runs
// through) and low thirteen bits below, at, and above the halfway point.
func TestCodecF16Loops(t *testing.T) {
	halves := make([]byte, 2<<16)
	for i := range 1 << 16 {
		binary.LittleEndian.PutUint16(halves[2*i:], uint16(i))
	}
	got, err := Decode(F16, halves, nil)
	if err != nil {
		t.Fatal(err)
	}
	for i, f := range got {
		if want := F16ToFloat32(uint16(i)); math.Float32bits(f) != math.Float32bits(want) {
			t.Fatalf("Decode of half %#04x: %#08x, want %#08x", i, math.Float32bits(f), math.Float32bits(want))
		}
	}

	var in []float32
	for sign := range uint32(2) {
		for e := range uint32(256) {
			for top := range uint32(1 << 10) {
				for _, low := range []uint32{0, 1, 0x0fff, 0x1000, 0x1001, 0x1fff} {
					in = append(in, math.Float32frombits(sign<<31|e<<23|top<<13|low))
				}
			}
		}
	}
	data, err := Encode(F16, in, nil)
	if err != nil {
		t.Fatal(err)
	}
	for i, f := range in {
		got, want := binary.LittleEndian.Uint16(data[2*i:]), Float32ToF16(f)
		if got != want {
			t.Fatalf("Encode of %#08x: %#04x, want %#04x", math.Float32bits(f), got, want)
		}
	}
}

// TestCodecF32Bits: F32 crosses bit for bit, NaN payloads and signed zeros
// included, into a buffer with room to spare and one without (so that
// Decode reads the bytes both aligned for float32s and not).
func TestCodecF32Bits(t *testing.T) {
	bits := []uint32{0, 0x80000000, 0x7fc00001, 0xffbfffff, 0x7f800000, 0x00000001, 0x3f800000, 0xc2f6e979}
	in := make([]float32, len(bits))
	for i, b := range bits {
		in[i] = math.Float32frombits(b)
	}
	for _, dst := range [][]byte{nil, make([]byte, 3, 64)} {
		data, err := Encode(F32, in, dst)
		if err != nil {
			t.Fatal(err)
		}
		data = data[len(dst):]
		for i, b := range bits {
			if got := binary.LittleEndian.Uint32(data[4*i:]); got != b {
				t.Fatalf("Encode of %#08x wrote %#08x", b, got)
			}
		}
		out, err := Decode(F32, data, make([]float32, 1, 2))
		if err != nil {
			t.Fatal(err)
		}
		for i, b := range bits {
			if got := math.Float32bits(out[1+i]); got != b {
				t.Fatalf("Decode of %#08x gave %#08x", b, got)
			}
		}
	}
}

func TestCodecErrors(t *testing.T) {
	if _, err := Encode(DType(9), []float32{1}, nil); err == nil {
		t.Error("Encode with an unknown dtype succeeded")
	}
	if _, err := Decode(DType(0), []byte{0, 0}, nil); err == nil {
		t.Error("Decode with an unknown dtype succeeded")
	}
	if _, err := Decode(F32, []byte{1, 2, 3}, nil); err == nil || !strings.Contains(err.Error(), "whole number") {
		t.Errorf("Decode of 3 bytes as f32: %v", err)
	}
	if _, err := NewActivation(F16, 2, 3, make([]float32, 5)); err == nil {
		t.Error("NewActivation with 5 floats for [2,3] succeeded")
	}
	if _, err := NewActivation(DType(7), 1, 1, []float32{1}); err == nil {
		t.Error("NewActivation with an unknown dtype succeeded")
	}
}

func TestParseDType(t *testing.T) {
	tests := []struct {
		in   string
		want DType
		ok   bool
	}{
		{"f32", F32, true}, {"float32", F32, true}, {"F16", F16, true},
		{"float16", F16, true}, {"bf16", BF16, true}, {"bfloat16", BF16, true},
		{"", 0, false}, {"f64", 0, false}, {"q8_0", 0, false},
	}
	for _, tt := range tests {
		got, err := ParseDType(tt.in)
		if (err == nil) != tt.ok || got != tt.want {
			t.Errorf("ParseDType(%q) = %v, %v", tt.in, got, err)
		}
		// What String prints must parse back.
		if tt.ok {
			if again, err := ParseDType(got.String()); err != nil || again != got {
				t.Errorf("ParseDType(%q.String()) = %v, %v", got, again, err)
			}
		}
	}
	if s := DType(9).String(); s != "dtype(9)" {
		t.Errorf("unknown dtype prints %q", s)
	}
}

func TestActivationValidate(t *testing.T) {
	tests := []struct {
		name string
		a    Activation
		err  string // "" = valid
	}{
		{"valid f32", Activation{DType: F32, Rows: 2, Cols: 3, Data: make([]byte, 24)}, ""},
		{"valid f16", Activation{DType: F16, Rows: 2, Cols: 3, Data: make([]byte, 12)}, ""},
		{"valid bf16", Activation{DType: BF16, Rows: 1, Cols: 1, Data: make([]byte, 2)}, ""},
		{"zero dtype", Activation{DType: 0, Rows: 1, Cols: 1, Data: make([]byte, 4)}, "unknown dtype 0"},
		{"unknown dtype", Activation{DType: 4, Rows: 1, Cols: 1, Data: make([]byte, 4)}, "unknown dtype 4"},
		{"zero rows", Activation{DType: F32, Rows: 0, Cols: 3}, "not positive"},
		{"negative cols", Activation{DType: F32, Rows: 2, Cols: -3}, "not positive"},
		{"short payload", Activation{DType: F32, Rows: 2, Cols: 3, Data: make([]byte, 23)}, "needs 24 bytes, payload has 23"},
		{"long payload", Activation{DType: F16, Rows: 2, Cols: 3, Data: make([]byte, 24)}, "needs 12 bytes, payload has 24"},
		{"nil payload", Activation{DType: BF16, Rows: 1, Cols: 1}, "needs 2 bytes, payload has 0"},
		// 2^20 × 2^9 f32 is 2 GiB; the size is refused before the payload
		// is looked at, so no such buffer is needed to test it.
		{"over the limit", Activation{DType: F32, Rows: 1 << 20, Cols: 1 << 9}, "over the"},
		{"just over the limit", Activation{DType: F16, Rows: 1<<29 + 1, Cols: 1}, "over the"},
		// A shape whose byte count wraps around 64 bits: (2^63-1)^2 × 4 is
		// 4 mod 2^64, which an unchecked product would take for a small,
		// matching payload (a peer controls both numbers).
		{"product wraps around", Activation{DType: F32, Rows: math.MaxInt, Cols: math.MaxInt, Data: make([]byte, 4)}, "over the"},
		{"huge cols", Activation{DType: F16, Rows: 1, Cols: math.MaxInt, Data: make([]byte, 2)}, "over the"},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			err := tt.a.Validate()
			switch {
			case tt.err == "" && err != nil:
				t.Fatalf("valid activation refused: %v", err)
			case tt.err != "" && err == nil:
				t.Fatalf("accepted, want error containing %q", tt.err)
			case tt.err != "" && !strings.Contains(err.Error(), tt.err):
				t.Fatalf("error %q does not contain %q", err, tt.err)
			}
			if tt.err != "" {
				if _, err := tt.a.Float32(); err == nil {
					t.Fatal("Float32 decoded an invalid activation")
				}
			}
		})
	}
	// Exactly at the limit is allowed (checked without allocating: the
	// payload error proves the size check passed).
	at := Activation{DType: F16, Rows: 1 << 29, Cols: 1}
	if err := at.Validate(); err == nil || !strings.Contains(err.Error(), "payload has 0") {
		t.Errorf("activation of exactly MaxActivationBytes: %v", err)
	}
}

// BenchmarkCodec encodes and decodes 16 rows of an 8B model's hidden state
// (a 16-row micro-batch's hop), as a stage does on either side of it.
func BenchmarkCodec(b *testing.B) {
	rng := rand.New(rand.NewPCG(5, 6))
	in := make([]float32, 16*4096)
	for i := range in {
		in[i] = float32(rng.NormFloat64())
	}
	for _, dt := range []DType{F32, F16, BF16} {
		data, _ := Encode(dt, in, nil)
		b.Run("encode/"+dt.String(), func(b *testing.B) {
			b.SetBytes(int64(4 * len(in)))
			buf := make([]byte, 0, len(data))
			for b.Loop() {
				buf, _ = Encode(dt, in, buf[:0])
			}
		})
		b.Run("decode/"+dt.String(), func(b *testing.B) {
			b.SetBytes(int64(4 * len(in)))
			out := make([]float32, 0, len(in))
			for b.Loop() {
				out, _ = Decode(dt, data, out[:0])
			}
		})
	}
}

// TestFloat32Shared: an aligned F32 activation's float32s share its memory;
// misaligned or other dtypes are decoded into new memory; both give
// Float32's values, and a bad activation is refused.
func TestFloat32Shared(t *testing.T) {
	in := []float32{1, -2.5, float32(math.Inf(1)), 3e-40}
	buf := make([]byte, 4*len(in)+1)
	tests := []struct {
		name   string
		dtype  DType
		data   []byte
		shared bool
	}{
		{"f32 aligned", F32, buf[:4*len(in)], littleEndian},
		{"f32 misaligned", F32, buf[1:], false},
		{"f16", F16, nil, false},
	}
	for _, tc := range tests {
		t.Run(tc.name, func(t *testing.T) {
			data, err := Encode(tc.dtype, in, tc.data[:0])
			if err != nil {
				t.Fatal(err)
			}
			a := &Activation{DType: tc.dtype, Rows: 2, Cols: 2, Data: data}
			want, err := a.Float32()
			if err != nil {
				t.Fatal(err)
			}
			got, err := a.Float32Shared()
			if err != nil {
				t.Fatal(err)
			}
			if len(got) != len(want) {
				t.Fatalf("%d values, want %d", len(got), len(want))
			}
			for i := range want {
				if math.Float32bits(got[i]) != math.Float32bits(want[i]) {
					t.Fatalf("value %d: %v, want %v", i, got[i], want[i])
				}
			}
			shares := unsafe.Pointer(unsafe.SliceData(got)) == unsafe.Pointer(unsafe.SliceData(a.Data))
			if shares != tc.shared {
				t.Fatalf("shares the payload: %v, want %v", shares, tc.shared)
			}
		})
	}
	if _, err := (&Activation{DType: F32, Rows: 2, Cols: 2, Data: make([]byte, 15)}).Float32Shared(); err == nil {
		t.Fatal("short payload: no error")
	}
}
