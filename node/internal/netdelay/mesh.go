package netdelay

import (
	"bytes"
	"context"
	"errors"
	"fmt"
	"os/exec"
	"strings"
	"time"
)

// Table is the nftables table (family ip) that Start puts in each
// namespace.
const Table = "meshdelay"

// MaxNodes is the most nodes Start relays between: relay ports are
// BasePort + 10*from + to.
const MaxNodes = 9

// Config is a set of namespaces on one bridge whose TCP connections to
// one port (libp2p's) go through delay relays.
type Config struct {
	Namespaces []string // node i's namespace is Namespaces[i-1]
	Addrs      []string // node i's address in its namespace
	Port       int      // the port whose connections are relayed (libp2p's 4001)
	Gateway    string   // the address the relays listen on, which every namespace reaches (the bridge's)
	BasePort   int      // the relay for node i's connections to node j listens on BasePort + 10*i + j
	Delay      time.Duration
}

// Mesh is a delay relay for every ordered pair of nodes. In node i's
// namespace an nftables rule sends its connections to node j's port to
// the relay for (i,j), which listens on the gateway in this process's
// namespace, dials node j, and forwards every chunk, both ways, the pair's
// delay after reading it. The delay is per unordered pair, so a hop costs
// it one way and twice it for a round trip whichever node dialed. Start
// before the nodes do, so that every connection between two of them
// crosses a relay; connections already open when the rules go in do not.
type Mesh struct {
	*Relay
	delays map[[2]int]*Delay // by pair (low, high)
}

// Start makes the relays and puts the rules in every namespace. On error
// it stops what it started; rules already put in stay with their
// namespaces (deleting a namespace deletes its rules).
func Start(ctx context.Context, cfg Config) (*Mesh, error) {
	n := len(cfg.Namespaces)
	if n != len(cfg.Addrs) || n > MaxNodes || cfg.Port <= 0 || cfg.BasePort <= 0 || cfg.BasePort+10*n+n > 65535 {
		return nil, fmt.Errorf("netdelay: bad config: %d namespaces, %d addresses (at most %d), port %d, base port %d",
			n, len(cfg.Addrs), MaxNodes, cfg.Port, cfg.BasePort)
	}
	m := &Mesh{Relay: NewRelay(), delays: map[[2]int]*Delay{}}
	for i := 1; i <= n; i++ {
		var rules []DNAT
		for j := 1; j <= n; j++ {
			if i == j {
				continue
			}
			pair := [2]int{min(i, j), max(i, j)}
			if m.delays[pair] == nil {
				m.delays[pair] = new(Delay)
				m.delays[pair].Set(cfg.Delay)
			}
			port := cfg.BasePort + 10*i + j
			dst := fmt.Sprintf("%s:%d", cfg.Addrs[j-1], cfg.Port)
			if _, err := m.Forward(fmt.Sprintf("%s:%d", cfg.Gateway, port), dst, m.delays[pair]); err != nil {
				m.Close()
				return nil, fmt.Errorf("relay %d→%d: %w", i, j, err)
			}
			rules = append(rules, DNAT{DstIP: cfg.Addrs[j-1], DstPort: cfg.Port, ToIP: cfg.Gateway, ToPort: port})
		}
		if err := InstallDNAT(ctx, cfg.Namespaces[i-1], rules); err != nil {
			m.Close()
			return nil, err
		}
	}
	return m, nil
}

// Set makes the hop between nodes i and j (both ways) d slower.
func (m *Mesh) Set(i, j int, d time.Duration) {
	m.delays[[2]int{min(i, j), max(i, j)}].Set(d)
}

// DNAT is one rule: TCP connections to DstIP:DstPort go to ToIP:ToPort.
type DNAT struct {
	DstIP   string
	DstPort int
	ToIP    string
	ToPort  int
}

// Rules is the nftables script of Table with the given rules, on the
// output hook (connections that the namespace's own processes open).
func Rules(rules []DNAT) string {
	var b strings.Builder
	fmt.Fprintf(&b, "table ip %s {\n chain out {\n  type nat hook output priority -100; policy accept;\n", Table)
	for _, r := range rules {
		fmt.Fprintf(&b, "  ip daddr %s tcp dport %d dnat to %s:%d\n", r.DstIP, r.DstPort, r.ToIP, r.ToPort)
	}
	// An empty postrouting nat chain: kernels before 4.18 translate the
	// replies only when the nat table has one.
	b.WriteString(" }\n chain post {\n  type nat hook postrouting priority 100; policy accept;\n }\n}\n")
	return b.String()
}

// InstallDNAT loads Rules(rules) into namespace ns (nft -f inside it).
func InstallDNAT(ctx context.Context, ns string, rules []DNAT) error {
	script := Rules(rules)
	cmd := exec.CommandContext(ctx, "ip", "netns", "exec", ns, "nft", "-f", "-")
	cmd.Stdin = strings.NewReader(script)
	if out, err := cmd.CombinedOutput(); err != nil {
		return fmt.Errorf("nft in %s: %w: %s\n%s", ns, err, bytes.TrimSpace(out), script)
	}
	return nil
}

// ErrNoNetem is the error of Netem on a kernel without the netem qdisc
// (sch_netem).
var ErrNoNetem = errors.New("this kernel has no netem qdisc (sch_netem)")

// Netem puts a netem qdisc that delays every packet by d as the root
// qdisc of device dev in namespace ns (ns "" is this process's). Every
// packet the device sends waits d. On a kernel without netem the error
// wraps ErrNoNetem.
func Netem(ctx context.Context, ns, dev string, d time.Duration) error {
	args := []string{"qdisc", "add", "dev", dev, "root", "netem", "delay", fmt.Sprintf("%dus", d.Microseconds())}
	name := "tc"
	if ns != "" {
		name, args = "ip", append([]string{"netns", "exec", ns, "tc"}, args...)
	}
	out, err := exec.CommandContext(ctx, name, args...).CombinedOutput()
	if err == nil {
		return nil
	}
	msg := bytes.TrimSpace(out)
	if bytes.Contains(msg, []byte("qdisc kind is unknown")) {
		err = fmt.Errorf("%w: %w", ErrNoNetem, err)
	}
	return fmt.Errorf("%s %s: %w: %s", name, strings.Join(args, " "), err, msg)
}
