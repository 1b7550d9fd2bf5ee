// Package meshtest holds the multi-process tests of the mesh: real
// `meshnode serve` and `meshnode join` processes, built once per run, talk
// over loopback (and over network namespaces when the tests run as root),
// and the tests act as an operator and a client would: they read the
// processes' output, query /api/status and send OpenAI requests. Greedy
// generations through every entry node are checked token for token
// against ollama's own unsplit forward pass, computed in the test process.
//
// The package has no code of its own; the tests are in *_test.go.
package meshtest
