package ggufstage

import (
	"fmt"
	"strings"

	"github.com/ollama/ollama/ml"
	"github.com/ollama/ollama/model"
)

// gpuLayers puts blocks [start,end) on the device, and the output layer
// too when the stage holds it (ollama numbers it after the last block).
func gpuLayers(dev *ml.DeviceInfo, start, end, total int) ml.GPULayersList {
	layers := make([]int, 0, end-start+1)
	for i := start; i < end; i++ {
		layers = append(layers, i)
	}
	if end == total {
		layers = append(layers, total)
	}
	return ml.GPULayersList{{DeviceID: dev.DeviceID, Layers: layers}}
}

// Devices lists the GPUs ggml can use in this process (none when no GPU
// backend library was found), probing with a dry-run load of path.
func Devices(path string) ([]ml.DeviceInfo, error) {
	backendMu.Lock()
	defer backendMu.Unlock()
	return devices(path)
}

// devices is Devices for callers that hold backendMu.
func devices(path string) (devs []ml.DeviceInfo, err error) {
	defer recoverErr(&err, "probing devices")
	defer allowAlloc() // after Close: the dry run must not disarm other engines' buffers
	m, err := model.New(path, ml.BackendParams{AllocMemory: false, NumThreads: 1})
	if err != nil {
		return nil, fmt.Errorf("probing devices with %s: %w", path, err)
	}
	defer m.Backend().Close()
	return m.Backend().BackendDevices(), nil
}

// PickDevice is the GPU that Open places a stage of the model at path on
// for Options.Device want, or nil for the CPU.
func PickDevice(path, want string) (*ml.DeviceInfo, error) {
	backendMu.Lock()
	defer backendMu.Unlock()
	return pickDevice(path, want)
}

// pickDevice resolves Options.Device to a GPU, or nil for the CPU. The
// caller holds backendMu.
func pickDevice(path, want string) (*ml.DeviceInfo, error) {
	want = strings.ToLower(want)
	if want == "cpu" {
		return nil, nil
	}
	devs, err := devices(path)
	if err != nil {
		return nil, err
	}
	for i := range devs {
		lib := strings.ToLower(devs[i].Library)
		if want == "" || want == "auto" || lib == want {
			return &devs[i], nil
		}
	}
	if want == "" || want == "auto" {
		return nil, nil
	}
	return nil, fmt.Errorf("no %s device: ggml found %d GPU(s); is the %s backend built and OLLAMA_LIBRARY_PATH set? (see deploy/gpu)", want, len(devs), strings.ToUpper(want))
}
