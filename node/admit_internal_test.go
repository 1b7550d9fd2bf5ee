package node

import (
	"errors"
	"testing"

	"github.com/meshnode/meshnode/node/planner"
	"github.com/meshnode/meshnode/node/scheduler"
)

// TestAdmit: a request queues while the mesh serves, and also while a
// model that ran has its pipeline rebuilt after a replan; it is refused
// at once for a model that never ran, one no placement fits, or a node
// that is leaving. /health reports the replan all the same.
func TestAdmit(t *testing.T) {
	served, other := &meshModel{}, &meshModel{}
	plan := planner.Plan{Stages: []planner.Stage{{Node: "a", Start: 0, End: 5}}}
	running := scheduler.Local(nil, nil)
	tests := []struct {
		name     string
		m        *mesh
		draining bool
		admit    error // errors.Is; nil admits
		health   error
	}{
		{"serving", &mesh{model: served, ran: served, plan: plan, pipe: running}, false, nil, nil},
		{"replanning a model that ran", &mesh{model: served, ran: served, plan: plan}, false, nil, errNoPipeline},
		{"never ran", &mesh{model: served, plan: plan}, false, errNoPipeline, errNoPipeline},
		{"another model ran", &mesh{model: served, ran: other, plan: plan}, false, errNoPipeline, errNoPipeline},
		{"no placement fits", &mesh{model: served, ran: served, planErr: errors.New("too little memory")}, false, errNoPipeline, errNoPipeline},
		{"no plan yet", &mesh{model: served, ran: served}, false, errNoPipeline, errNoPipeline},
		{"leaving", &mesh{model: served, ran: served, plan: plan}, true, errDraining, errDraining},
	}
	for _, tt := range tests {
		s := &Model{mesh: tt.m}
		s.draining.Store(tt.draining)
		if err := s.admit(); !errors.Is(err, tt.admit) || (err == nil) != (tt.admit == nil) {
			t.Errorf("%s: admit() = %v, want %v", tt.name, err, tt.admit)
		}
		if err := s.health(); !errors.Is(err, tt.health) || (err == nil) != (tt.health == nil) {
			t.Errorf("%s: health() = %v, want %v", tt.name, err, tt.health)
		}
	}
}
