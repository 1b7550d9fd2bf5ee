package pipeline

import "github.com/meshnode/meshnode/node/scheduler"

// The scheduler drives a Pipeline as it drives a local engine.
var _ scheduler.Pipeline = (*Pipeline)(nil)
