package main

import (
	"context"
	"fmt"
	"io"
	"net/http"
	"strings"
	"time"
)

func runLeave(ctx context.Context, args []string) error {
	fs := newFlags("leave [flags]", `Asks the local node to leave the mesh gracefully: it stops taking new
requests, lets the mesh move its layers to other nodes (they fetch them
while it still serves them), finishes the requests it is running, and
exits. SIGTERM does the same.`, `  meshnode leave
  meshnode leave --node http://127.0.0.1:9402 --api-key KEY`)
	nodeURL := fs.String("node", "http://127.0.0.1:9337", "the node's HTTP address")
	key := fs.String("api-key", "", "the node's API key, if it has one")
	if err := parse(fs, args); err != nil {
		return err
	}
	req, err := http.NewRequestWithContext(ctx, http.MethodPost, strings.TrimRight(*nodeURL, "/")+"/api/leave", nil)
	if err != nil {
		return err
	}
	if *key != "" {
		req.Header.Set("Authorization", "Bearer "+*key)
	}
	resp, err := (&http.Client{Timeout: 10 * time.Second}).Do(req)
	if err != nil {
		return fmt.Errorf("no node answers at %s (is it running?): %w", *nodeURL, err)
	}
	defer resp.Body.Close()
	body, _ := io.ReadAll(io.LimitReader(resp.Body, 4096))
	if resp.StatusCode != http.StatusOK {
		return fmt.Errorf("node refused: %s: %s", resp.Status, strings.TrimSpace(string(body)))
	}
	fmt.Println("the node is draining and will exit when the mesh no longer needs it")
	return nil
}
