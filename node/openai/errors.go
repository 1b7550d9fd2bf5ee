package openai

import (
	"context"
	"errors"
	"fmt"
	"net/http"
)

// OpenAI error types; clients mostly look at the status, some at these.
const (
	typeInvalidRequest = "invalid_request_error"
	typeServer         = "server_error"
	typeRateLimit      = "requests" // what OpenAI sends with a 429
)

// apiError is an error as the client sees it: a status and OpenAI's body.
type apiError struct {
	status  int
	message string
	typ     string
	param   string // "" is sent as null
	code    string // "" is sent as null
}

// errorBody is OpenAI's error envelope; param and code are null when unset.
type errorBody struct {
	Error errorDetail `json:"error"`
}

type errorDetail struct {
	Message string  `json:"message"`
	Type    string  `json:"type"`
	Param   *string `json:"param"`
	Code    *string `json:"code"`
}

func (e *apiError) body() errorBody {
	d := errorDetail{Message: e.message, Type: e.typ}
	if e.param != "" {
		d.Param = &e.param
	}
	if e.code != "" {
		d.Code = &e.code
	}
	return errorBody{Error: d}
}

func invalidRequest(param, code, format string, args ...any) *apiError {
	return &apiError{
		status:  http.StatusBadRequest,
		message: fmt.Sprintf(format, args...),
		typ:     typeInvalidRequest,
		param:   param,
		code:    code,
	}
}

func missingParam(param string) *apiError {
	return invalidRequest(param, "missing_required_parameter", "Missing required parameter: '%s'.", param)
}

func invalidValue(param, format string, args ...any) *apiError {
	return invalidRequest(param, "invalid_value", "Invalid '%s': %s.", param, fmt.Sprintf(format, args...))
}

func unsupported(param, format string, args ...any) *apiError {
	return invalidRequest(param, "unsupported_parameter", "Unsupported '%s': %s.", param, fmt.Sprintf(format, args...))
}

func modelNotFound(id string) *apiError {
	return &apiError{
		status:  http.StatusNotFound,
		message: fmt.Sprintf("The model '%s' does not exist or is not served here.", id),
		typ:     typeInvalidRequest,
		param:   "model",
		code:    "model_not_found",
	}
}

func internalError(err error) *apiError {
	return &apiError{
		status:  http.StatusInternalServerError,
		message: fmt.Sprintf("internal error: %v", err),
		typ:     typeServer,
	}
}

// backendError maps an error from the Backend to what the client gets.
// what names the failed step for server errors; param names the request
// field the prompt came from, for context errors. Client errors carry the
// backend's message alone: it is written for the client.
func backendError(err error, what, param string) *apiError {
	switch {
	case errors.Is(err, ErrOverloaded):
		return &apiError{status: http.StatusTooManyRequests, message: err.Error(), typ: typeRateLimit, code: "rate_limit_exceeded"}
	case errors.Is(err, ErrUnavailable):
		return &apiError{status: http.StatusServiceUnavailable, message: err.Error(), typ: typeServer, code: "service_unavailable"}
	case errors.Is(err, ErrContextLength):
		return invalidRequest(param, "context_length_exceeded", "%s", err.Error())
	case errors.Is(err, ErrInvalidParam):
		return invalidRequest("", "invalid_value", "%s", err.Error())
	case errors.Is(err, context.Canceled), errors.Is(err, context.DeadlineExceeded):
		// Only reached when the ctx error did not come from the client going
		// away (that case writes nothing); report it as a server failure.
		return &apiError{status: http.StatusServiceUnavailable, message: fmt.Sprintf("%s: %v", what, err), typ: typeServer, code: "service_unavailable"}
	default:
		return internalError(fmt.Errorf("%s: %w", what, err))
	}
}
