package host

import (
	"bytes"
	"crypto/hkdf"
	"crypto/rand"
	"crypto/sha256"
	"crypto/subtle"
	"encoding/base64"
	"encoding/hex"
	"errors"
	"fmt"
	"io/fs"
	"os"
	"path/filepath"
	"strings"

	"github.com/libp2p/go-libp2p/core/crypto"
)

// File names inside a node's data directory.
const (
	PeerKeyFile = "peer.key"
	MeshKeyFile = "mesh.key"
)

// LoadOrCreateKey returns the node's libp2p identity, an Ed25519 key kept at
// dataDir/peer.key. The peer ID is derived from it, so reusing the file across
// restarts keeps the node's identity (and its place in other nodes' plans).
func LoadOrCreateKey(dataDir string) (crypto.PrivKey, error) {
	if err := os.MkdirAll(dataDir, 0o700); err != nil {
		return nil, fmt.Errorf("create data dir %s: %w", dataDir, err)
	}
	path := filepath.Join(dataDir, PeerKeyFile)
	raw, err := os.ReadFile(path)
	switch {
	case err == nil:
		key, err := crypto.UnmarshalPrivateKey(raw)
		if err != nil {
			return nil, fmt.Errorf("decode peer key %s: %w", path, err)
		}
		if key.Type() != crypto.Ed25519 {
			return nil, fmt.Errorf("peer key %s: want Ed25519, got %s", path, key.Type())
		}
		return key, nil
	case !errors.Is(err, fs.ErrNotExist):
		return nil, fmt.Errorf("read peer key %s: %w", path, err)
	}

	key, _, err := crypto.GenerateEd25519Key(rand.Reader)
	if err != nil {
		return nil, fmt.Errorf("generate peer key: %w", err)
	}
	raw, err = crypto.MarshalPrivateKey(key)
	if err != nil {
		return nil, fmt.Errorf("encode peer key: %w", err)
	}
	if err := writeSecret(path, raw); err != nil {
		return nil, err
	}
	return key, nil
}

// MeshKey is the shared secret of one mesh. Every key a mesh uses on the wire
// (the connection proof and link cipher keys, the gossip encryption key, the
// mDNS service tag) is derived from it with HKDF under a distinct label, so no derived key
// reveals another or the mesh key itself.
type MeshKey [32]byte

// meshKeyPrefix versions the text form; a future format gets a new prefix.
const meshKeyPrefix = "mk1_"

// meshKeyCheckLen bytes of SHA-256 follow the key in its text form so a
// mistyped key fails at parse time instead of as a refused connection.
const meshKeyCheckLen = 4

// GenerateMeshKey returns a fresh random mesh key.
func GenerateMeshKey() (MeshKey, error) {
	var k MeshKey
	if _, err := rand.Read(k[:]); err != nil {
		return MeshKey{}, fmt.Errorf("generate mesh key: %w", err)
	}
	return k, nil
}

// String returns the text form "mk1_" + base64url(key ‖ checksum). It is the
// secret itself: never log it.
func (k MeshKey) String() string {
	sum := sha256.Sum256(k[:])
	buf := append(k[:len(k):len(k)], sum[:meshKeyCheckLen]...)
	return meshKeyPrefix + base64.RawURLEncoding.EncodeToString(buf)
}

// IsZero reports whether k is the zero value (no mesh key).
func (k MeshKey) IsZero() bool { return k == MeshKey{} }

// ParseMeshKey parses the text form written by String.
func ParseMeshKey(s string) (MeshKey, error) {
	s = strings.TrimSpace(s)
	body, ok := strings.CutPrefix(s, meshKeyPrefix)
	if !ok {
		return MeshKey{}, fmt.Errorf("parse mesh key: missing %q prefix", meshKeyPrefix)
	}
	raw, err := base64.RawURLEncoding.DecodeString(body)
	if err != nil {
		return MeshKey{}, fmt.Errorf("parse mesh key: %w", err)
	}
	var k MeshKey
	if len(raw) != len(k)+meshKeyCheckLen {
		return MeshKey{}, fmt.Errorf("parse mesh key: %d bytes, want %d", len(raw), len(k)+meshKeyCheckLen)
	}
	copy(k[:], raw)
	sum := sha256.Sum256(k[:])
	if subtle.ConstantTimeCompare(sum[:meshKeyCheckLen], raw[len(k):]) != 1 {
		return MeshKey{}, errors.New("parse mesh key: checksum mismatch (mistyped key?)")
	}
	if k.IsZero() {
		return MeshKey{}, errors.New("parse mesh key: all-zero key")
	}
	return k, nil
}

// derive expands the mesh key under label; labels keep each use independent.
func (k MeshKey) derive(label string, n int) []byte {
	out, err := hkdf.Key(sha256.New, k[:], nil, "meshnode "+label, n)
	if err != nil {
		// Only possible for n > 255*32, which no caller asks for.
		panic(fmt.Sprintf("derive %s key: %v", label, err))
	}
	return out
}

// GossipKey is the AES-256 key for memberlist's gossip encryption.
func (k MeshKey) GossipKey() [32]byte {
	var g [32]byte
	copy(g[:], k.derive("gossip v1", 32))
	return g
}

// ServiceTag is a short public tag naming the mesh in mDNS. It is derived one
// way, so broadcasting it on the LAN leaks nothing usable about the key.
func (k MeshKey) ServiceTag() string { return hex.EncodeToString(k.derive("mdns v1", 6)) }

// LoadMeshKey reads dataDir/mesh.key.
func LoadMeshKey(dataDir string) (MeshKey, error) {
	path := filepath.Join(dataDir, MeshKeyFile)
	raw, err := os.ReadFile(path)
	if err != nil {
		return MeshKey{}, fmt.Errorf("read mesh key: %w", err)
	}
	k, err := ParseMeshKey(string(raw))
	if err != nil {
		return MeshKey{}, fmt.Errorf("%s: %w", path, err)
	}
	return k, nil
}

// SaveMeshKey writes k to dataDir/mesh.key (0600), e.g. after `meshnode join`.
func SaveMeshKey(dataDir string, k MeshKey) error {
	if k.IsZero() {
		return errors.New("save mesh key: zero key")
	}
	if err := os.MkdirAll(dataDir, 0o700); err != nil {
		return fmt.Errorf("create data dir %s: %w", dataDir, err)
	}
	return writeSecret(filepath.Join(dataDir, MeshKeyFile), []byte(k.String()+"\n"))
}

// LoadOrCreateMeshKey returns the stored mesh key, creating and storing a new
// one (a new mesh) when there is none. created tells which happened.
func LoadOrCreateMeshKey(dataDir string) (k MeshKey, created bool, err error) {
	k, err = LoadMeshKey(dataDir)
	if err == nil {
		return k, false, nil
	}
	if !errors.Is(err, fs.ErrNotExist) {
		return MeshKey{}, false, err
	}
	if k, err = GenerateMeshKey(); err != nil {
		return MeshKey{}, false, err
	}
	if err := SaveMeshKey(dataDir, k); err != nil {
		return MeshKey{}, false, err
	}
	return k, true, nil
}

// writeSecret writes data to path with mode 0600 through a temporary file and
// a rename, so a crash never leaves a half-written key behind.
func writeSecret(path string, data []byte) error {
	if old, err := os.ReadFile(path); err == nil && bytes.Equal(old, data) {
		return nil
	}
	tmp, err := os.CreateTemp(filepath.Dir(path), "."+filepath.Base(path)+".tmp*")
	if err != nil {
		return fmt.Errorf("write %s: %w", path, err)
	}
	defer os.Remove(tmp.Name()) // no-op after a successful rename
	if err := tmp.Chmod(0o600); err != nil {
		tmp.Close()
		return fmt.Errorf("write %s: %w", path, err)
	}
	if _, err := tmp.Write(data); err != nil {
		tmp.Close()
		return fmt.Errorf("write %s: %w", path, err)
	}
	if err := tmp.Sync(); err != nil {
		tmp.Close()
		return fmt.Errorf("write %s: %w", path, err)
	}
	if err := tmp.Close(); err != nil {
		return fmt.Errorf("write %s: %w", path, err)
	}
	if err := os.Rename(tmp.Name(), path); err != nil {
		return fmt.Errorf("write %s: %w", path, err)
	}
	return nil
}
